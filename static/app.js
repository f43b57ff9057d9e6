// sidelock dashboard: live updates, countdowns, filter and force-release.
//
// Safety: values from the server are only ever put into the page as text
// (textContent), or as the server-rendered live fragment, which askama has
// escaped and which is parsed in an inert document (its scripts never run;
// the Content-Security-Policy allows no inline script either).
(function () {
  'use strict';

  var TOKEN_KEY = 'sidelock.apiToken';
  var MIN_GAP_MS = 1000; // at most one refresh per second
  var LIVE_EVERY_MS = 10000; // safety net while the event stream is up
  var POLL_EVERY_MS = 5000; // fallback while it is down
  var MAX_BACKOFF_MS = 15000;

  function storedToken() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (e) { return ''; }
  }
  function storeToken(token) {
    try {
      if (token) sessionStorage.setItem(TOKEN_KEY, token); else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) { /* storage disabled: the token lives in memory only */ }
  }

  // The sign-in page: keep the token for this tab, then let the form post.
  var signIn = document.getElementById('sign-in');
  if (signIn) {
    signIn.addEventListener('submit', function () {
      storeToken(document.getElementById('sign-in-token').value.trim());
    });
  }

  var live = document.getElementById('live');
  if (!live) return;
  document.documentElement.classList.add('js');

  var tokenRequired = document.body.dataset.apiToken === 'required';
  var apiToken = tokenRequired ? storedToken() : '';
  var adminToken = '';
  var clockOffset = 0; // server clock minus browser clock, in ms

  // ---- formatting (the same rules as the server's) ----
  function pad2(n) { return (n < 10 ? '0' : '') + n; }
  function fmtDuration(ms) {
    ms = Math.max(0, Math.floor(ms));
    var s = Math.floor(ms / 1000);
    if (ms < 1000) return ms + ' ms';
    if (s < 60) return s + ' s';
    if (s < 3600) return Math.floor(s / 60) + 'm ' + pad2(s % 60) + 's';
    if (s < 86400) return Math.floor(s / 3600) + 'h ' + pad2(Math.floor((s % 3600) / 60)) + 'm';
    return Math.floor(s / 86400) + 'd ' + pad2(Math.floor((s % 86400) / 3600)) + 'h';
  }

  // ---- status indicator ----
  var statusEl = document.getElementById('live-status');
  function setStatus(state, text, title) {
    if (!statusEl) return;
    statusEl.dataset.wanted = JSON.stringify([state, text, title]);
    // The page is live, but what it shows is not: the backend cannot be read.
    if (state !== 'error' && live.querySelector('[data-backend="down"]')) {
      state = 'error';
      text = 'Backend down';
      title = 'The sidecar answers, but its backend cannot be reached: holders, queues and stale keys are unknown';
    }
    statusEl.dataset.state = state;
    statusEl.querySelector('.live-text').textContent = text;
    statusEl.title = title || text;
  }

  // ---- flash messages ----
  var flashEl = document.getElementById('flash');
  var flashTimer = null;
  function flash(kind, text) {
    flashEl.className = 'alert ' + kind;
    flashEl.textContent = text;
    flashEl.hidden = false;
    clearTimeout(flashTimer);
    flashTimer = setTimeout(function () { flashEl.hidden = true; }, 10000);
  }

  function authHeaders(token) {
    return token ? { Authorization: 'Bearer ' + token } : {};
  }

  // ---- clock and countdowns ----
  function readClock() {
    var root = live.querySelector('[data-now-ms]');
    if (root) clockOffset = Number(root.dataset.nowMs) - Date.now();
  }
  function tick() {
    var now = Date.now() + clockOffset;
    live.querySelectorAll('[data-since-ms]').forEach(function (el) {
      el.textContent = fmtDuration(now - Number(el.dataset.sinceMs));
    });
    live.querySelectorAll('[data-expires-at-ms]').forEach(function (el) {
      var left = Number(el.dataset.expiresAtMs) - now;
      el.textContent = left > 0 ? fmtDuration(left) : 'expired';
      el.classList.toggle('ttl-ok', left >= 5000);
      el.classList.toggle('ttl-warn', left > 0 && left < 5000);
      el.classList.toggle('ttl-over', left <= 0);
    });
  }

  // ---- refreshing the live part ----
  var refreshing = false;
  var again = false;
  var lastRefresh = 0;
  var refreshTimer = null;

  function fragmentUrl() {
    return '/dashboard/live' + location.search;
  }

  async function refresh() {
    if (refreshing) { again = true; return; }
    refreshing = true;
    lastRefresh = Date.now();
    try {
      var res = await fetch(fragmentUrl(), {
        headers: authHeaders(apiToken),
        credentials: 'same-origin',
        cache: 'no-store'
      });
      if (res.status === 401) {
        setStatus('error', 'Signed out', 'The dashboard session ended: reload the page to sign in again');
        return;
      }
      if (!res.ok) throw new Error('HTTP ' + res.status);
      var html = await res.text();
      var doc = new DOMParser().parseFromString(html, 'text/html');
      var nodes = Array.prototype.map.call(doc.body.childNodes, function (n) {
        return document.importNode(n, true);
      });
      live.replaceChildren.apply(live, nodes);
      readClock();
      tick();
      live.dataset.refreshedAt = String(Date.now());
      if (statusEl && statusEl.dataset.wanted) setStatus.apply(null, JSON.parse(statusEl.dataset.wanted));
      if (statusEl && statusEl.dataset.state === 'error') showStreamState();
    } catch (e) {
      setStatus('error', 'Sidecar unreachable', 'The last refresh failed (' + e.message + '); retrying');
    } finally {
      refreshing = false;
      if (again) { again = false; scheduleRefresh(); }
    }
  }

  // Coalesces bursts of events into at most one refresh per MIN_GAP_MS.
  function scheduleRefresh() {
    if (refreshTimer) return;
    var wait = Math.max(120, lastRefresh + MIN_GAP_MS - Date.now());
    refreshTimer = setTimeout(function () { refreshTimer = null; refresh(); }, wait);
  }

  // ---- the event stream (fetch, so the API token can go in a header) ----
  var streamUp = false;
  var backoff = 1000;
  var lastEvent = '';

  function handleBlock(block) {
    var type = '';
    var data = '';
    block.split('\n').forEach(function (line) {
      if (line.indexOf('event:') === 0) type = line.slice(6).trim();
      else if (line.indexOf('data:') === 0) data += line.slice(5).trim();
    });
    if (!type) return; // keep-alive comment
    try {
      var e = JSON.parse(data);
      lastEvent = type + ' ' + (e.kind === 'semaphore' ? 'semaphore ' : '') + e.name + ' (' + e.owner + ')';
    } catch (err) {
      lastEvent = type;
    }
    setStatus('live', 'Live', 'Following /v1/events · last event: ' + lastEvent);
    scheduleRefresh();
  }

  // The indicator after a failed refresh recovered: what the stream is doing.
  function showStreamState() {
    if (streamUp) setStatus('live', 'Live', 'Following /v1/events');
    else setStatus('polling', 'Polling', 'Refreshing every ' + POLL_EVERY_MS / 1000 + ' s');
  }

  function streamDown(reason) {
    streamUp = false;
    setStatus('polling', 'Reconnecting', (reason || 'The event stream dropped') + ' — refreshing every ' + POLL_EVERY_MS / 1000 + ' s meanwhile');
    setTimeout(connect, backoff);
    backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
  }

  async function connect() {
    if (tokenRequired && !apiToken) {
      showTokenForm('Kept in this tab\'s sessionStorage only.');
      setStatus('polling', 'Polling', 'Refreshing every ' + POLL_EVERY_MS / 1000 + ' s; enter the API token for live updates');
      return;
    }
    setStatus('connecting', 'Connecting');
    var res;
    try {
      res = await fetch('/v1/events', { headers: authHeaders(apiToken), cache: 'no-store' });
    } catch (e) {
      streamDown('The sidecar cannot be reached');
      return;
    }
    if (res.status === 401) {
      apiToken = '';
      storeToken('');
      showTokenForm('That token was not accepted. Enter the API token:');
      setStatus('polling', 'Polling', 'The API token was refused; refreshing every ' + POLL_EVERY_MS / 1000 + ' s');
      return;
    }
    if (!res.ok || !res.body) {
      streamDown('The event stream answered HTTP ' + res.status);
      return;
    }
    streamUp = true;
    backoff = 1000;
    setStatus('live', 'Live', 'Following /v1/events');
    refresh(); // catch up with whatever happened while disconnected
    var reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    var buffer = '';
    try {
      for (;;) {
        var chunk = await reader.read();
        if (chunk.done) break;
        buffer = (buffer + chunk.value).replace(/\r\n/g, '\n');
        var end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          handleBlock(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
      streamDown('The sidecar closed the event stream');
    } catch (e) {
      streamDown('The event stream failed');
    }
  }

  // ---- API token form (only when the sidecar requires one) ----
  var tokenForm = document.getElementById('token-form');
  function showTokenForm(message) {
    if (!tokenForm) return;
    document.getElementById('token-message').textContent = message;
    tokenForm.hidden = false;
  }
  if (tokenForm) {
    tokenForm.addEventListener('submit', function (e) {
      e.preventDefault();
      apiToken = document.getElementById('token-input').value.trim();
      storeToken(apiToken);
      tokenForm.hidden = true;
      connect();
    });
  }
  var signOut = document.getElementById('sign-out');
  if (signOut) signOut.addEventListener('submit', function () { storeToken(''); });

  // ---- filter ----
  var filter = document.getElementById('filter');
  var prefix = document.getElementById('prefix');
  var limit = document.getElementById('limit');
  var filterTimer = null;
  function applyFilter() {
    var params = new URLSearchParams();
    var p = prefix.value.trim();
    if (p) params.set('prefix', p);
    if (limit.value !== filter.dataset.defaultLimit) params.set('limit', limit.value);
    var qs = params.toString();
    history.replaceState(null, '', qs ? '/?' + qs : '/');
    refresh();
  }
  filter.addEventListener('submit', function (e) { e.preventDefault(); applyFilter(); });
  prefix.addEventListener('input', function () {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(applyFilter, 250);
  });
  limit.addEventListener('change', applyFilter);

  // ---- force-release ----
  var dialog = document.getElementById('force-dialog');
  var forceForm = document.getElementById('force-form');
  var forceToken = document.getElementById('force-token');
  var forceReason = document.getElementById('force-reason');
  var forceError = document.getElementById('force-error');
  var forceConfirm = document.getElementById('force-confirm');
  var target = null;

  document.addEventListener('click', function (e) {
    var button = e.target.closest('button[data-action="force-release"]');
    if (!button || button.disabled) return;
    var holders = Number(button.dataset.holders) || 0;
    target = { kind: button.dataset.kind, name: button.dataset.name };
    document.getElementById('force-lock').textContent = target.name;
    document.getElementById('force-count').textContent =
      holders === 1 ? 'its holder' : holders + ' holders';
    forceToken.value = adminToken;
    forceError.hidden = true;
    dialog.showModal();
    (adminToken ? forceConfirm : forceToken).focus();
  });

  forceForm.addEventListener('submit', async function (e) {
    if (e.submitter && e.submitter.value === 'cancel') return; // the dialog closes itself
    e.preventDefault();
    var token = forceToken.value.trim();
    if (!token) {
      forceError.textContent = 'The admin token (SIDELOCK_ADMIN_TOKEN) is required.';
      forceError.hidden = false;
      forceToken.focus();
      return;
    }
    var name = target.name;
    var url = '/v1/admin/' + encodeURIComponent(target.kind) + '/' + encodeURIComponent(name) +
      '?reason=' + encodeURIComponent(forceReason.value.trim() || 'dashboard');
    forceConfirm.disabled = true;
    try {
      var res = await fetch(url, { method: 'DELETE', headers: authHeaders(token), cache: 'no-store' });
      var body = await res.json().catch(function () { return {}; });
      if (res.ok) {
        adminToken = token;
        dialog.close();
        var n = Number(body.released) || 0;
        flash('ok', 'Force-released ' + name + ': ' + n + (n === 1 ? ' lease' : ' leases') + ' removed.');
        refresh();
      } else {
        if (res.status === 401 || res.status === 403) adminToken = '';
        forceError.textContent = 'Not released (HTTP ' + res.status + '): ' + (body.detail || res.statusText);
        forceError.hidden = false;
      }
    } catch (err) {
      forceError.textContent = 'The request failed: ' + err.message;
      forceError.hidden = false;
    } finally {
      forceConfirm.disabled = false;
    }
  });

  // ---- start ----
  readClock();
  tick();
  setInterval(tick, 1000);
  setInterval(function () {
    var every = streamUp ? LIVE_EVERY_MS : POLL_EVERY_MS;
    if (Date.now() - lastRefresh >= every) refresh();
  }, 1000);
  lastRefresh = Date.now();
  connect();
})();
