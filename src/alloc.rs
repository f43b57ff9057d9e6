//! The process's global allocator: large buffers in mappings of their own,
//! with no header, so pages nobody writes stay non-resident.
//!
//! Every HTTP/1 connection owns two 8 KiB buffers, fixed sizes in hyper:
//! a read buffer of which a waiting request uses a few hundred bytes, and a
//! write buffer that stays empty until the response. With 10,000 waiting
//! requests that is 160 MiB of address space. Inside malloc's heap, pages
//! of those buffers are shared with small allocations and become resident.
//! glibc's own mmap threshold keeps them apart but writes a chunk header
//! into the first page of every mapping, so each buffer still costs a
//! resident page, written or not.
//!
//! Rust hands the size back on `dealloc`, so a mapping needs no header:
//! here an allocation of [`THRESHOLD`] bytes or more is an anonymous mapping
//! of its own, page-aligned, and only the pages a buffer really writes
//! become resident — one for a waiting request's read buffer, none for its
//! write buffer. Everything smaller goes to the system allocator.
//! The cost is a `mmap`/`munmap` pair per large allocation, and hyper
//! allocates a fresh read buffer for nearly every request (the previous
//! request still shares the old one when it reserves room for the next
//! read). A mapping is also a page fault on first write and, in a
//! multi-threaded process, a TLB shootdown on `munmap`: measured, a third
//! of the throughput with 32 clients. So while the process has few
//! connections open ([`CONNECTIONS`] below [`REUSE_BELOW`]), freed buffers
//! of hyper's size are kept in `SPARES` and handed out again, written
//! pages and all; with many connections open — the waiting and holding
//! ones that this module exists for — every buffer is a fresh mapping
//! again, so idle connections still cost only the pages they write.

use std::sync::atomic::AtomicUsize;

/// Makes every thread allocate its small blocks from one malloc arena.
///
/// glibc gives threads that contend for the main arena arenas of their
/// own, up to eight per core. Each keeps its own free holes, which other
/// threads' allocations cannot fill: with 10,000 waiting or holding
/// connections, whose blocks are allocated by whichever worker accepted or
/// polled them, one arena is 2 to 3 MiB smaller than three, and pairs/s
/// with 32 clients did not change (`BENCHMARKS.md`). glibc's per-thread
/// caches still serve most allocations without the arena's lock.
/// Call it before any thread is started; without glibc it does nothing.
pub fn share_one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tunable of the allocator; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Open HTTP connections of this process, kept by the server's accept loop.
pub static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// The large-buffer allocator itself: Linux only (`mmap` flags and page
/// size); elsewhere the system allocator serves every block.
#[cfg(target_os = "linux")]
mod mapped {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::ptr;
    use std::sync::atomic::{AtomicPtr, Ordering};

    use super::CONNECTIONS;

    /// Allocations from this size up get a mapping of their own.
    pub const THRESHOLD: usize = 8 * 1024;
    /// Alignment every mapping has (the smallest page size of the platforms we run on).
    const PAGE: usize = 4096;

    /// Freed buffers are kept for reuse only below this many open connections
    /// (at most `SPARES`' length of them, 256 KiB).
    pub const REUSE_BELOW: usize = 256;
    /// Freed mappings of exactly [`THRESHOLD`] bytes (hyper's buffer size),
    /// kept for reuse; null slots are empty.
    static SPARES: [AtomicPtr<u8>; 32] = [const { AtomicPtr::new(ptr::null_mut()) }; 32];

    fn reusing() -> bool {
        CONNECTIONS.load(Ordering::Relaxed) < REUSE_BELOW
    }

    /// A kept mapping of [`THRESHOLD`] bytes, or null.
    fn take_spare() -> *mut u8 {
        for slot in &SPARES {
            if !slot.load(Ordering::Relaxed).is_null() {
                let p = slot.swap(ptr::null_mut(), Ordering::Acquire);
                if !p.is_null() {
                    return p;
                }
            }
        }
        ptr::null_mut()
    }

    /// Keeps the mapping `p` of [`THRESHOLD`] bytes; false when every slot is taken.
    fn keep_spare(p: *mut u8) -> bool {
        SPARES.iter().any(|slot| {
            slot.compare_exchange(ptr::null_mut(), p, Ordering::Release, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Large allocations in their own mappings, the rest from [`System`].
    pub struct Pages;

    fn mapped(layout: Layout) -> bool {
        layout.size() >= THRESHOLD && layout.align() <= PAGE
    }

    /// A fresh anonymous mapping of `size` bytes, or null.
    fn map(size: usize) -> *mut u8 {
        // SAFETY: an anonymous private mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            ptr::null_mut()
        } else {
            p.cast()
        }
    }

    // SAFETY: every pointer is either from System (and returned to it) or from a
    // mapping of exactly `layout.size()` bytes (and unmapped with that size);
    // which one is decided by the layout alone, which the caller must pass back
    // unchanged, so the two never mix.
    unsafe impl GlobalAlloc for Pages {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if !mapped(layout) {
                // SAFETY: forwarded with the caller's guarantees.
                return unsafe { System.alloc(layout) };
            }
            if layout.size() == THRESHOLD && reusing() {
                let p = take_spare();
                if !p.is_null() {
                    return p;
                }
            }
            map(layout.size())
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            if mapped(layout) {
                // Never a spare: fresh anonymous mappings are zero-filled.
                map(layout.size())
            } else {
                // SAFETY: forwarded with the caller's guarantees.
                unsafe { System.alloc_zeroed(layout) }
            }
        }

        unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
            if mapped(layout) {
                if layout.size() == THRESHOLD && reusing() && keep_spare(p) {
                    return;
                }
                // SAFETY: `p` is a mapping of `layout.size()` bytes made by `alloc`.
                unsafe {
                    libc::munmap(p.cast(), layout.size());
                }
            } else {
                // SAFETY: `p` came from System with this layout.
                unsafe { System.dealloc(p, layout) }
            }
        }

        unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: the caller guarantees `new_size` is valid for `layout.align()`.
            let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
            match (mapped(layout), mapped(new)) {
                // SAFETY: both sides belong to System.
                (false, false) => unsafe { System.realloc(p, layout, new_size) },
                (true, true) => {
                    // SAFETY: `p` is a mapping of `layout.size()` bytes; the kernel
                    // moves or grows it, keeping its contents.
                    let q = unsafe {
                        libc::mremap(p.cast(), layout.size(), new_size, libc::MREMAP_MAYMOVE)
                    };
                    if q == libc::MAP_FAILED {
                        ptr::null_mut()
                    } else {
                        q.cast()
                    }
                }
                _ => {
                    // SAFETY: a fresh block of the new layout, the overlap copied,
                    // the old block freed with its own layout.
                    unsafe {
                        let q = self.alloc(new);
                        if !q.is_null() {
                            ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                            self.dealloc(p, layout);
                        }
                        q
                    }
                }
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn small_large_and_crossing_reallocations_keep_their_bytes() {
            let a = Pages;
            for (from, to) in [
                (100, 200),
                (100, 20_000),
                (20_000, 100),
                (THRESHOLD, 3 * THRESHOLD),
                (3 * THRESHOLD, THRESHOLD),
            ] {
                let layout = Layout::from_size_align(from, 8).unwrap();
                // SAFETY: layouts are non-zero; every block is freed with its layout.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    for i in 0..from {
                        *p.add(i) = (i % 251) as u8;
                    }
                    let q = a.realloc(p, layout, to);
                    assert!(!q.is_null());
                    for i in 0..from.min(to) {
                        assert_eq!(*q.add(i), (i % 251) as u8, "{from} -> {to} at {i}");
                    }
                    a.dealloc(q, Layout::from_size_align(to, 8).unwrap());
                }
            }
        }

        #[test]
        fn zeroed_buffers_are_zero_even_with_a_written_one_kept_for_reuse() {
            let layout = Layout::from_size_align(THRESHOLD, 8).unwrap();
            // SAFETY: every block is freed with its layout.
            unsafe {
                let p = Pages.alloc(layout);
                p.write_bytes(7, THRESHOLD);
                Pages.dealloc(p, layout);
                let zeroed = Pages.alloc_zeroed(layout);
                assert!((0..THRESHOLD).all(|i| *zeroed.add(i) == 0));
                Pages.dealloc(zeroed, layout);
                let q = Pages.alloc(layout);
                assert!(!q.is_null());
                assert_eq!(q as usize % PAGE, 0);
                Pages.dealloc(q, layout);
            }
        }

        #[test]
        fn with_many_connections_open_a_freed_buffer_is_not_handed_out_again() {
            // Other tests of this process only lose spares' speed meanwhile.
            CONNECTIONS.fetch_add(REUSE_BELOW, Ordering::Relaxed);
            let layout = Layout::from_size_align(THRESHOLD, 8).unwrap();
            // SAFETY: every block is freed with its layout.
            let fresh = unsafe {
                let p = Pages.alloc(layout);
                p.write_bytes(7, THRESHOLD);
                Pages.dealloc(p, layout);
                let q = Pages.alloc(layout);
                let fresh = (0..THRESHOLD).all(|i| *q.add(i) == 0);
                Pages.dealloc(q, layout);
                fresh
            };
            CONNECTIONS.fetch_sub(REUSE_BELOW, Ordering::Relaxed);
            assert!(
                fresh,
                "a written buffer was reused with many connections open"
            );
        }

        #[test]
        fn large_zeroed_blocks_are_zero_and_page_aligned() {
            let layout = Layout::from_size_align(THRESHOLD + 1, 64).unwrap();
            // SAFETY: non-zero layout, freed with the same layout.
            unsafe {
                let p = Pages.alloc_zeroed(layout);
                assert_eq!(p as usize % PAGE, 0);
                assert!((0..layout.size()).all(|i| *p.add(i) == 0));
                Pages.dealloc(p, layout);
            }
        }
    }
}

#[cfg(target_os = "linux")]
pub use mapped::{Pages, REUSE_BELOW, THRESHOLD};
