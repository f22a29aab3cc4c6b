package bench

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
)

// runcPath is Debian 12's runc, which the runc_criu baseline drives.
const runcPath = "/usr/sbin/runc"

// Machine describes where a report was measured.
type Machine struct {
	Kernel   string `json:"kernel"`
	CPUs     int    `json:"cpus"`
	MemBytes int64  `json:"mem_bytes"`
	CRIU     int    `json:"criu_version"`
	Runc     string `json:"runc_version,omitempty"`
	Runsc    string `json:"runsc_version,omitempty"`
	Go       string `json:"go"`
	// PageReporting tells whether the guest hands free memory back to its hypervisor
	// (virtio-balloon free page reporting): then every write to freshly freed memory
	// faults in the host, and dumps and restores run several times slower. "off" after
	// scripts/install-deps.sh; "" on machines without it.
	PageReporting string `json:"page_reporting,omitempty"`
	// CPUModel, THP (transparent huge pages: always/madvise/never) and PageFaultUS (one
	// user page fault, µs; see memory.go) explain most of the difference between runs
	// on different machines: restores fault their memory in page by page.
	CPUModel    string  `json:"cpu_model,omitempty"`
	THP         string  `json:"thp,omitempty"`
	PageFaultUS float64 `json:"page_fault_us,omitempty"`
	// StealPercent is the share of the machine's CPU time its hypervisor gave to other
	// guests during the run (steal over all CPU time): on a shared host it stretches
	// every figure, and run to run it explains more than any change does (2026-12-01:
	// 15-39% over a night whose p50s were 1.3-3 times the evening's).
	StealPercent float64 `json:"steal_percent"`
	// MemoryWarmup is how the run found the guest's free memory (see memory.go).
	MemoryWarmup *MemoryWarmup `json:"memory_warmup,omitempty"`
}

func machineInfo() Machine {
	m := Machine{CPUs: runtime.NumCPU(), Go: runtime.Version()}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		m.MemBytes = int64(si.Totalram) * int64(si.Unit)
	}
	m.CRIU, _ = criu.Version()
	m.PageReporting = pageReporting()
	m.CPUModel, m.THP, m.PageFaultUS = cpuModel(), thpMode(), pageFaultMicros()
	if out, err := exec.Command(runcPath, "--version").Output(); err == nil {
		m.Runc = strings.TrimPrefix(strings.SplitN(string(out), "\n", 2)[0], "runc version ")
	}
	if p, err := findRunsc(); err == nil {
		if out, err := exec.Command(p, "--version").Output(); err == nil {
			m.Runsc = strings.TrimPrefix(strings.SplitN(string(out), "\n", 2)[0], "runsc version ")
		}
	}
	return m
}

// pageReporting reads the guest's free page reporting state: "on" when free blocks of
// the reporting order (at most the buddy allocator's largest, 10) go to the hypervisor.
func pageReporting() string {
	b, err := os.ReadFile("/sys/module/page_reporting/parameters/page_reporting_order")
	if err != nil {
		return ""
	}
	if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n > 10 {
		return "off"
	}
	return "on"
}

// cpuTimes returns the machine's steal and total CPU time so far, in clock ticks (the
// first line of /proc/stat).
func cpuTimes() (steal, total uint64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0
	}
	for i, v := range f[1:] {
		n, _ := strconv.ParseUint(v, 10, 64)
		if i < 8 { // user nice system idle iowait irq softirq steal (guest time is in user)
			total += n
		}
		if i == 7 {
			steal = n
		}
	}
	return steal, total
}

// stealSince is StealPercent since cpuTimes returned steal0, total0.
func stealSince(steal0, total0 uint64) float64 {
	steal, total := cpuTimes()
	if total <= total0 {
		return 0
	}
	return 100 * float64(steal-steal0) / float64(total-total0)
}
