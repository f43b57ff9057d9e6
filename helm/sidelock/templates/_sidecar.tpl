{{/*
=============================================================================
Sidecar injection: the named templates application charts include.

Add this chart as a dependency (named "sidelock"), then in the pod template of
the application's Deployment/StatefulSet/Job:

  template:
    metadata:
      labels:
        {{- include "sidelock.podLabels" $ | nindent 8 }}
      annotations:
        {{- include "sidelock.podAnnotations" $ | nindent 8 }}
    spec:
      terminationGracePeriodSeconds: {{ include "sidelock.terminationGracePeriodSeconds" $ }}
      {{- with include "sidelock.initContainers" $ }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: app
          env:
            {{- include "sidelock.clientEnv" $ | nindent 12 }}
        {{- include "sidelock.containers" $ | nindent 8 }}
      volumes:
        {{- include "sidelock.volumes" $ | nindent 8 }}

Every template accepts either
  - the top-level context `$`: the sidecar values are then `.Values.sidelock`
    (in an application chart) or `.Values` (inside this chart), or
  - a dict (dict "root" $ "values" .Values.someAlias) to name the values
    explicitly, e.g. when the dependency has an alias.

  sidelock.container          the sidecar container, as one list item; with
                              sidecar.native it carries restartPolicy: Always
                              and belongs in initContainers
  sidelock.initContainers     the container when sidecar.native, else nothing
  sidelock.containers         the container when not sidecar.native, else nothing
  sidelock.volumes            the config volume (and, with socket.enabled,
                              the socket's emptyDir), as list items
  sidelock.socketVolumeMount  with socket.enabled, the application
                              container's volumeMount of the socket's
                              directory (list item); else nothing
  sidelock.podLabels          pod labels (the metrics Service selects on them)
  sidelock.podAnnotations     checksum of the config (rolls pods on changes)
  sidelock.terminationGracePeriodSeconds
  sidelock.clientEnv          SIDELOCK_URL and SIDELOCK_API_TOKEN for the
                              application container (what `sidelock run` and
                              curl scripts read); SIDELOCK_SOCKET with
                              socket.enabled (curl --unix-socket)
  sidelock.leaderReadinessProbe
                              with election.readinessProbe.enabled, a
                              `readinessProbe:` for the application container
                              on /v1/elections/<name>/ready: only the leader's
                              pod is Ready, so its Services route to it alone
=============================================================================
*/}}

{{/*
Resolve the calling context into {"root", "values"}: called as
  {{- $ctx := dict -}}{{- $_ := include "sidelock.context" (list . $ctx) -}}
(a template can only return a string, so the dict is filled in place).
*/}}
{{- define "sidelock.context" -}}
{{- $in := index . 0 -}}
{{- $ctx := index . 1 -}}
{{- if hasKey $in "root" -}}
{{- $values := get $in "values" -}}
{{- if not $values -}}
{{- $values = get $in.root.Values "sidelock" -}}
{{- end -}}
{{- if not $values -}}
{{- $values = $in.root.Values -}}
{{- end -}}
{{- $_ := set $ctx "root" $in.root -}}
{{- $_ := set $ctx "values" $values -}}
{{- else -}}
{{- $_ := set $ctx "root" $in -}}
{{- $_ := set $ctx "values" (get $in.Values "sidelock" | default $in.Values) -}}
{{- end -}}
{{- end -}}

{{/*
Checks that JSON schema cannot express. Renders nothing; fails with a message.
*/}}
{{- define "sidelock.validate" -}}
{{- $v := .values -}}
{{- $kube := .root.Capabilities.KubeVersion.Version -}}
{{- if and $v.sidecar.native (semverCompare "<1.29.0-0" $kube) -}}
{{- fail (printf "sidelock: sidecar.native=true needs Kubernetes 1.29 or later (native sidecars: init containers with restartPolicy: Always), but the cluster is %s. Set sidecar.native=false to add sidelock as a plain container." $kube) -}}
{{- end -}}
{{- $grace := include "sidelock.durationSeconds" $v.config.shutdownGrace | int -}}
{{- if lt (int $v.sidecar.terminationGracePeriodSeconds) (add $grace 5) -}}
{{- fail (printf "sidelock: sidecar.terminationGracePeriodSeconds=%d is too short: sidelock needs config.shutdownGrace (%s) plus at least 5 seconds to release its locks on SIGTERM; use %d or more." (int $v.sidecar.terminationGracePeriodSeconds) (include "sidelock.duration" $v.config.shutdownGrace) (add $grace 5)) -}}
{{- end -}}
{{- if gt (include "sidelock.durationMs" $v.config.defaultTtl | int64) (include "sidelock.durationMs" $v.config.maxTtl | int64) -}}
{{- fail (printf "sidelock: config.defaultTtl (%s) must not be longer than config.maxTtl (%s); sidelock would refuse to start." (include "sidelock.duration" $v.config.defaultTtl) (include "sidelock.duration" $v.config.maxTtl)) -}}
{{- end -}}
{{- if lt (include "sidelock.durationMs" $v.config.maxTtl | int64) 100 -}}
{{- fail (printf "sidelock: config.maxTtl (%s) must be at least 100ms, the shortest ttl of a hold stream or campaign; sidelock would refuse to start." (include "sidelock.duration" $v.config.maxTtl)) -}}
{{- end -}}
{{- if and (not $v.backend.urlFromSecret.name) (regexMatch "(?i)^[a-z][a-z0-9+.-]*://[^@]*:[^@]*@|[?&][^=&]*(pass|pwd|secret|token|auth|credential|key)[^=&]*=" $v.backend.url) -}}
{{- fail "sidelock: backend.url contains a password, and it would be stored in a ConfigMap. Put the complete URL in a Secret and name it in backend.urlFromSecret.name (key backend.urlFromSecret.key); keep backend.url without credentials." -}}
{{- end -}}
{{- end -}}

{{/*
sidelock.toml, mounted from the ConfigMap at /etc/sidelock/sidelock.toml.
Keys are sidelock's flag names in snake_case. No secret goes here: the tokens
and a backend URL with credentials come from a Secret through the environment.
*/}}
{{- define "sidelock.configToml" -}}
{{- $v := .values -}}
{{- $c := $v.config -}}
# sidelock configuration rendered by the sidelock Helm chart.
# Precedence: command-line flags > SIDELOCK_* environment > this file.
{{- if $v.socket.enabled }}
listen = {{ list (include "sidelock.listenAddress" .) (printf "unix:%s" (include "sidelock.socketPath" .)) | toJson }}
{{- else }}
listen = {{ include "sidelock.listenAddress" . | toJson }}
{{- end }}
{{- with $v.sidecar.allowedHosts }}
allowed_hosts = {{ toJson . }}
{{- end }}
{{- if $v.backend.urlFromSecret.name }}
# backend: SIDELOCK_BACKEND from Secret {{ $v.backend.urlFromSecret.name }}
{{- else }}
backend = {{ $v.backend.url | toJson }}
{{- end }}
default_ttl = {{ include "sidelock.duration" $c.defaultTtl | toJson }}
max_ttl = {{ include "sidelock.duration" $c.maxTtl | toJson }}
max_wait = {{ include "sidelock.duration" $c.maxWait | toJson }}
lock_delay = {{ include "sidelock.duration" $c.lockDelay | toJson }}
stale_after = {{ include "sidelock.duration" $c.staleAfter | toJson }}
max_waiters = {{ int64 $c.maxWaiters }}
max_total_waiters = {{ int64 $c.maxTotalWaiters }}
max_held = {{ int64 $c.maxHeld }}
max_connections = {{ int64 $c.maxConnections }}
header_read_timeout = {{ include "sidelock.duration" $c.headerReadTimeout | toJson }}
idle_timeout = {{ include "sidelock.duration" $c.idleTimeout | toJson }}
body_read_timeout = {{ include "sidelock.duration" $c.bodyReadTimeout | toJson }}
write_timeout = {{ include "sidelock.duration" $c.writeTimeout | toJson }}
dashboard_session_ttl = {{ include "sidelock.duration" $c.dashboardSessionTtl | toJson }}
metrics_lock_labels = {{ $c.metricsLockLabels }}
shutdown_grace = {{ include "sidelock.duration" $c.shutdownGrace | toJson }}
log_format = {{ $c.logFormat | toJson }}
{{- end -}}

{{/*
host:port sidelock binds to, and the URL the application uses to reach it.
*/}}
{{- define "sidelock.listenAddress" -}}
{{- if contains ":" .values.sidecar.listenHost -}}
{{- printf "[%s]:%d" .values.sidecar.listenHost (int .values.sidecar.port) -}}
{{- else -}}
{{- printf "%s:%d" .values.sidecar.listenHost (int .values.sidecar.port) -}}
{{- end -}}
{{- end -}}

{{- define "sidelock.url" -}}
{{- if contains ":" .values.sidecar.listenHost -}}
{{- printf "http://[::1]:%d" (int .values.sidecar.port) -}}
{{- else -}}
{{- printf "http://127.0.0.1:%d" (int .values.sidecar.port) -}}
{{- end -}}
{{- end -}}

{{- define "sidelock.socketPath" -}}
{{- printf "%s/%s" .values.socket.dir .values.socket.name -}}
{{- end -}}

{{- define "sidelock.socketVolumeName" -}}
{{- printf "%s-socket" .values.sidecar.containerName | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sidelock.configVolumeName" -}}
{{- printf "%s-config" .values.sidecar.containerName | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
One probe: httpGet on the sidecar port plus the timing fields from values.
*/}}
{{- define "sidelock.probe" -}}
{{- $probe := index . 0 -}}
{{- $path := index . 1 -}}
httpGet:
  path: {{ $path }}
  port: sidelock
  scheme: HTTP
{{ toYaml (omit $probe "enabled") }}
{{- end -}}

{{/*
The sidecar container, as a single list item.
*/}}
{{- define "sidelock.container" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- include "sidelock.validate" $ctx -}}
{{- $v := $ctx.values -}}
{{- $secret := include "sidelock.secretName" $ctx -}}
- name: {{ $v.sidecar.containerName }}
  image: {{ include "sidelock.image" $ctx | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if $v.sidecar.native }}
  # Native sidecar: started before the application containers, stopped after them.
  restartPolicy: Always
  {{- end }}
  args:
    - serve
    - --config
    - /etc/sidelock/sidelock.toml
    {{- range $v.sidecar.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: SIDELOCK_SIDECAR_ID
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: SIDELOCK_API_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $secret }}
          key: {{ $v.auth.apiTokenKey }}
    {{- if $v.auth.adminEnabled }}
    - name: SIDELOCK_ADMIN_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $secret }}
          key: {{ $v.auth.adminTokenKey }}
    {{- end }}
    {{- if $v.backend.urlFromSecret.name }}
    - name: SIDELOCK_BACKEND
      valueFrom:
        secretKeyRef:
          name: {{ $v.backend.urlFromSecret.name }}
          key: {{ $v.backend.urlFromSecret.key }}
    {{- end }}
    - name: SIDELOCK_LOG
      value: {{ $v.config.logLevel | quote }}
    {{- with $v.sidecar.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: sidelock
      containerPort: {{ int $v.sidecar.port }}
      protocol: TCP
  {{- if $v.sidecar.startupProbe.enabled }}
  startupProbe:
    {{- include "sidelock.probe" (list $v.sidecar.startupProbe "/healthz") | nindent 4 }}
  {{- end }}
  {{- if $v.sidecar.livenessProbe.enabled }}
  livenessProbe:
    {{- include "sidelock.probe" (list $v.sidecar.livenessProbe "/healthz") | nindent 4 }}
  {{- end }}
  {{- if $v.sidecar.readinessProbe.enabled }}
  readinessProbe:
    {{- include "sidelock.probe" (list $v.sidecar.readinessProbe "/readyz") | nindent 4 }}
  {{- end }}
  {{- with $v.sidecar.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.sidecar.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: {{ include "sidelock.configVolumeName" $ctx }}
      mountPath: /etc/sidelock
      readOnly: true
    {{- if $v.socket.enabled }}
    - name: {{ include "sidelock.socketVolumeName" $ctx }}
      mountPath: {{ $v.socket.dir }}
    {{- end }}
    {{- with $v.sidecar.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{- define "sidelock.initContainers" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- if $ctx.values.sidecar.native -}}
{{- include "sidelock.container" $ctx -}}
{{- end -}}
{{- end -}}

{{- define "sidelock.containers" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- if not $ctx.values.sidecar.native -}}
{{- include "sidelock.container" $ctx -}}
{{- end -}}
{{- end -}}

{{- define "sidelock.volumes" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
- name: {{ include "sidelock.configVolumeName" $ctx }}
  configMap:
    name: {{ include "sidelock.configMapName" $ctx }}
{{- if $ctx.values.socket.enabled }}
- name: {{ include "sidelock.socketVolumeName" $ctx }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "sidelock.socketVolumeMount" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- if $ctx.values.socket.enabled -}}
- name: {{ include "sidelock.socketVolumeName" $ctx }}
  mountPath: {{ $ctx.values.socket.dir }}
{{- end -}}
{{- end -}}

{{- define "sidelock.podLabels" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- include "sidelock.instanceLabel" $ctx -}}
{{- end -}}

{{- define "sidelock.podAnnotations" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
checksum/sidelock-config: {{ include "sidelock.configToml" $ctx | sha256sum }}
{{- end -}}

{{- define "sidelock.terminationGracePeriodSeconds" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- int $ctx.values.sidecar.terminationGracePeriodSeconds -}}
{{- end -}}

{{- define "sidelock.clientEnv" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
- name: SIDELOCK_URL
  value: {{ include "sidelock.url" $ctx | quote }}
- name: SIDELOCK_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sidelock.secretName" $ctx }}
      key: {{ $ctx.values.auth.apiTokenKey }}
{{- if $ctx.values.socket.enabled }}
- name: SIDELOCK_SOCKET
  value: {{ include "sidelock.socketPath" $ctx | quote }}
{{- end }}
{{- end -}}

{{- define "sidelock.leaderReadinessProbe" -}}
{{- $ctx := dict -}}
{{- $_ := include "sidelock.context" (list . $ctx) -}}
{{- $p := $ctx.values.election.readinessProbe -}}
{{- if $p.enabled -}}
readinessProbe:
  httpGet:
    {{- /* A probe may name only its own container's ports: the number. */}}
    path: /v1/elections/{{ $p.name }}/ready
    port: {{ int $ctx.values.sidecar.port }}
    scheme: HTTP
  periodSeconds: {{ int ($p.periodSeconds | default 2) }}
  timeoutSeconds: {{ int ($p.timeoutSeconds | default 1) }}
  failureThreshold: {{ int ($p.failureThreshold | default 1) }}
  successThreshold: 1
{{- end -}}
{{- end -}}
