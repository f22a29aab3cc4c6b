package zygote

import (
	"sync"

	"golang.org/x/sys/unix"
)

// Buffers of copyBatch bytes for copyPages, mapped and faulted in once and kept.
//
// A fresh buffer of the Go heap was faulted in by the rewind's first read into it, page
// by page: W1, the copy of ~2 MB from a Python zygote spent 6-12 ms touching a new
// buffer and 1-1.5 ms when the heap happened to reuse one (this machine's page fault
// ~20 µs). Kept outside the Go heap, the scavenger cannot give the pages back to the
// kernel either. At most copyBuffersKept are kept (copyBatch each); a rewind that finds
// none free maps one for itself, unmapped after.
const copyBuffersKept = 2

var (
	copyBuffers     = make(chan []byte, copyBuffersKept)
	copyBuffersWarm sync.Once
)

// warmCopyBuffer maps one kept buffer in the background, once per cairn process: the
// first rewind then finds it ready. Called where tracking starts.
func warmCopyBuffer() {
	copyBuffersWarm.Do(func() {
		go func() {
			if b, err := mapCopyBuffer(); err == nil {
				putCopyBuffer(b)
			}
		}()
	})
}

// getCopyBuffer returns a buffer of copyBatch bytes whose pages are in memory.
func getCopyBuffer() ([]byte, error) {
	select {
	case b := <-copyBuffers:
		return b, nil
	default:
		return mapCopyBuffer()
	}
}

// putCopyBuffer keeps b for the next copy, or unmaps it if enough are kept.
func putCopyBuffer(b []byte) {
	select {
	case copyBuffers <- b:
	default:
		unix.Munmap(b)
	}
}

// mapCopyBuffer maps an anonymous buffer with its pages faulted in (MAP_POPULATE).
func mapCopyBuffer() ([]byte, error) {
	return unix.Mmap(-1, 0, copyBatch, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
}
