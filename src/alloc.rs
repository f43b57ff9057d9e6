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
//! The cost is a `mmap`/`munmap` pair per large allocation, which glibc
//! already made with its threshold at this size; the connection buffers
//! live as long as their connection.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;

/// Allocations from this size up get a mapping of their own.
pub const THRESHOLD: usize = 8 * 1024;
/// Alignment every mapping has (the smallest page size of the platforms we run on).
const PAGE: usize = 4096;

/// Large allocations in their own mappings, the rest from [`System`].
pub struct Pages;

fn mapped(layout: Layout) -> bool {
    layout.size() >= THRESHOLD && layout.align() <= PAGE
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
        // SAFETY: an anonymous private mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                layout.size(),
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

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if mapped(layout) {
            // SAFETY: as `alloc`; anonymous mappings are zero-filled.
            unsafe { self.alloc(layout) }
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if mapped(layout) {
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
