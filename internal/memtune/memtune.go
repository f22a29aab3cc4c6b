// Package memtune sets the Go garbage collector's pace for cairn's own processes (the
// cairn command, which runs an engine in process, and cairnd).
//
// cairn's engine allocates little per operation but steadily (reads of /proc, the
// metadata's rows, image compaction in the background), and keeps a small live heap, so
// at Go's default pace (GOGC=100) it collects every few operations. A collection that
// overlaps a checkpoint or a rollback takes CPU from the tracer thread that holds the
// sandbox's processes stopped (these machines have two), and drafts that thread into
// marking when it allocates; memory the collector gave back is faulted in again later
// (~20 µs a page on the project's virtual machines). W1, three alternating runs each
// (`cairn bench --workload w1 --iterations 20 --no-baselines`): rollback p50 14.2 ms at
// GOGC=100, 11.7 at 400, 9.0 at 800; checkpoint p50 15.2, 13.8, 13.0; the rewind's
// /proc checks 2.2 → 1.0 ms.
//
// So, unless the environment says otherwise, the collector runs when the heap has grown
// by eight times what was live after the last collection, and a soft limit bounds the
// whole Go memory (GOMEMLIMIT's meaning) to the smaller of 1 GiB and an eighth of the
// machine's memory: near it, the collector runs as often as needed instead.
package memtune

import (
	"os"
	"runtime/debug"

	"golang.org/x/sys/unix"
)

const (
	// Percent is the GOGC cairn's processes run with unless GOGC is set.
	Percent = 800
	// maxLimit caps the soft memory limit set unless GOMEMLIMIT is set.
	maxLimit = 1 << 30
)

// Apply sets the collector's pace and the soft memory limit, each unless its
// environment variable (GOGC, GOMEMLIMIT) is set, which the runtime has applied.
func Apply() {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(Percent)
	}
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		debug.SetMemoryLimit(Limit())
	}
}

// Limit is the soft memory limit Apply sets: an eighth of the machine's memory, at most
// 1 GiB.
func Limit() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return maxLimit
	}
	return min(int64(si.Totalram)*int64(si.Unit)/8, maxLimit)
}
