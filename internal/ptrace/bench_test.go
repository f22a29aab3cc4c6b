package ptrace

import (
	"os/exec"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
)

// BenchmarkStop stops two sleeping processes (seize, Interrupt, Wait) beside a busy
// goroutine, as a rollback stops the sandbox's processes beside its revert plan, and
// detaches them; colocated (as Interrupt does) or not. It reports the percentiles of
// the time until both are stopped.
//
//	go test -run - -bench Stop -benchtime 1000x ./internal/ptrace/
func BenchmarkStop(b *testing.B) {
	prereq.Root(b, "ptrace of arbitrary processes needs root")
	var pids []int
	for range 2 {
		c := exec.Command("cat")
		w, err := c.StdinPipe()
		if err != nil {
			b.Fatal(err)
		}
		defer w.Close()
		if err := c.Start(); err != nil {
			b.Fatal(err)
		}
		defer c.Wait()
		defer c.Process.Kill()
		pids = append(pids, c.Process.Pid)
	}
	var done atomic.Bool
	defer done.Store(true)
	go func() {
		for !done.Load() {
			x := 0
			for i := range 1000 {
				x += i
			}
			runtime.Gosched()
		}
	}()
	tr := NewTracer()
	defer tr.Close()
	for _, on := range []bool{true, false} {
		name := map[bool]string{true: "colocated", false: "not-colocated"}[on]
		b.Run(name, func(b *testing.B) {
			defer func(c bool) { colocation = c }(colocation)
			colocation = on
			var ds []time.Duration
			err := tr.Do(func() error {
				for b.Loop() {
					var ps []*Tracee
					t0 := time.Now()
					for _, pid := range pids {
						p, err := Seize(pid)
						if err != nil {
							return err
						}
						ps = append(ps, p)
						if err := p.Interrupt(); err != nil {
							return err
						}
					}
					for _, p := range ps {
						if err := p.Wait(time.Second); err != nil {
							return err
						}
					}
					ds = append(ds, time.Since(t0))
					for _, p := range ps {
						if err := p.Detach(); err != nil {
							return err
						}
					}
					time.Sleep(time.Millisecond) // asleep again in read(2)
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
			slices.Sort(ds)
			for _, q := range []struct {
				name string
				p    float64
			}{{"p50-µs", 0.50}, {"p90-µs", 0.90}, {"p99-µs", 0.99}} {
				b.ReportMetric(float64(ds[int(q.p*float64(len(ds)-1))].Microseconds()), q.name)
			}
		})
	}
}
