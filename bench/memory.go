package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Guest memory warm-up. On these virtual machines, memory the guest has not written
// since the hypervisor last took it back (all of it after a boot, while free page
// reporting was on) is backed by the host only at its first write, which then costs a
// host page fault: measured here, the first write to 17.6 GiB of free memory ran at
// ~0.27 GiB/s, the second at ~3.4 GiB/s. CRIU dumps write fresh page cache and restores
// fill fresh anonymous memory, so on a machine that has just booted every figure of a
// run is 2-5× worse than on one that has run for a while (W1 standby restores: ~550 ms
// instead of ~120). Writing once to the free memory before measuring makes runs
// comparable. It does not last: with free page reporting off (scripts/install-deps.sh)
// the host still took most of it back within hours (a warm-up at 0.30 GiB/s, 54 s, the
// same afternoon), so every run warms up again; a machine already backed takes seconds.

// MemoryWarmup says how a run found the guest's free memory and what it did about it.
type MemoryWarmup struct {
	// FirstTouchGiBps is the speed of the first write to the first 256 MiB of free
	// memory. That is the memory freed last, often backed when the rest is not:
	// WarmGiBps, over all of it, says more (a few GiB/s backed, well under 1 not).
	FirstTouchGiBps float64 `json:"first_touch_gib_per_s"`
	// WarmedBytes were written once before the run, at WarmGiBps, in Seconds.
	WarmedBytes int64   `json:"warmed_bytes"`
	WarmGiBps   float64 `json:"warm_gib_per_s,omitempty"`
	Seconds     float64 `json:"seconds"`
	// Skipped says why the warm-up did not run (only the first 256 MiB were measured).
	Skipped string `json:"skipped,omitempty"`
}

const warmChunk = 256 << 20

// warmMemory writes once to the guest's free memory, less a reserve, holding it all
// until the end so that each write lands on a different page, then frees it. limit
// caps the bytes written (0: no cap). It measures the first chunk whatever it does.
func warmMemory(progress io.Writer, warm bool, limit int64) (*MemoryWarmup, error) {
	free, total, err := memInfo()
	if err != nil {
		return nil, err
	}
	target := free - max(2<<30, total/10)
	if limit > 0 {
		target = min(target, limit)
	}
	w := &MemoryWarmup{}
	switch {
	case !warm:
		w.Skipped = "--warm-memory=false"
		target = warmChunk
	case pageReporting() == "on":
		// Freed memory goes back to the host within seconds: a warm-up would not last.
		w.Skipped = "free page reporting is on (scripts/install-deps.sh switches it off)"
		target = warmChunk
	case target < warmChunk:
		w.Skipped = fmt.Sprintf("only %d MiB free beyond the reserve", max(target, 0)>>20)
		target = warmChunk
	}
	var chunks [][]byte
	defer func() {
		for _, c := range chunks {
			unix.Munmap(c)
		}
	}()
	start, next := time.Now(), int64(1<<30)
	for done := int64(0); done < target; done += warmChunk {
		c, err := unix.Mmap(-1, 0, warmChunk, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
		if err != nil {
			break
		}
		chunks = append(chunks, c)
		t := time.Now()
		if err := unix.Madvise(c, unix.MADV_POPULATE_WRITE); err != nil {
			break // out of memory, or a kernel without MADV_POPULATE_WRITE: stop here
		}
		if done == 0 {
			w.FirstTouchGiBps = gibps(warmChunk, time.Since(t))
			if w.Skipped != "" {
				return w, nil
			}
			if progress != nil {
				fmt.Fprintf(progress, "bench: writing once to %.1f GiB of free guest memory so the host backs it (first write here: %.2f GiB/s; --warm-memory=false skips)\n",
					float64(target)/(1<<30), w.FirstTouchGiBps)
			}
		}
		w.WarmedBytes = done + warmChunk
		if progress != nil && w.WarmedBytes >= next {
			fmt.Fprintf(progress, "bench: warmed %.0f / %.1f GiB\n", float64(w.WarmedBytes)/(1<<30), float64(target)/(1<<30))
			next += 4 << 30
		}
	}
	w.Seconds = time.Since(start).Seconds()
	w.WarmGiBps = gibps(w.WarmedBytes, time.Since(start))
	return w, nil
}

func gibps(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / (1 << 30) / d.Seconds()
}

// memInfo returns the free memory (MemFree, not MemAvailable: the warm-up must not push
// out the page cache) and the total, in bytes.
func memInfo() (free, total int64, err error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return 0, 0, err
	}
	return int64(si.Freeram) * int64(si.Unit), int64(si.Totalram) * int64(si.Unit), nil
}

// pageFaultMicros measures what one page fault of user space costs: a write to each
// 4 KiB page of 32 MiB of fresh memory kept out of huge pages. ~1 µs on bare metal and
// most virtual machines; ~21 µs was measured on machines of this project's kind, where
// it made CRIU restores run at ~190 MB/s (install-deps.sh turns THP on for that).
func pageFaultMicros() float64 {
	const n = 32 << 20
	m, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0
	}
	defer unix.Munmap(m)
	unix.Madvise(m, unix.MADV_NOHUGEPAGE)
	start := time.Now()
	for i := 0; i < n; i += 4096 {
		m[i] = 1
	}
	return float64(time.Since(start).Nanoseconds()) / 1000 / (n / 4096)
}

// thpMode is the system's transparent huge page mode ("always", "madvise", "never").
func thpMode() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	s := string(b)
	if i, j := strings.IndexByte(s, '['), strings.IndexByte(s, ']'); i >= 0 && j > i {
		return s[i+1 : j]
	}
	return ""
}

// cpuModel is /proc/cpuinfo's model name of the first CPU.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}
