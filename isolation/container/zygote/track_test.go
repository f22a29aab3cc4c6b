package zygote

import (
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/internal/dirty"
	"github.com/cairn-sandbox/cairn/isolation"
)

// TestCapturedKeepsPagesScannedBetween: pages a scan finds between a capture's scan of a
// process (before, the process stopped) and the start of its new zygote's set
// (captured, the process running again) are in that set, as in every older one: a
// rewind's later scan may run in between, and a set that missed them would let a rewind
// to the new checkpoint leave them as the process wrote them.
func TestCapturedKeepsPagesScannedBetween(t *testing.T) {
	older, newer := isolation.Proc{Pid: 1 << 30, StartTime: 1}, isolation.Proc{Pid: 1<<30 + 1, StartTime: 2}
	// As before leaves a tracked process: an older zygote's set, and the new one open.
	k := &track{differ: map[isolation.Proc]dirty.Set{older: {{Start: 0x1000, End: 0x2000}}, making: nil}}
	ts := &Tracks{procs: map[int]*track{42: k}}
	between := dirty.Set{{Start: 0x8000, End: 0xa000}}
	k.add(between)
	ts.captured(&Record{Procs: []Proc{{Zygote: newer}}}, []int{42})
	if got := k.differ[newer]; !slices.Equal(got, between) {
		t.Errorf("the new zygote's set is %v, want the pages scanned in between %v", got, between)
	}
	if want := (dirty.Set{{Start: 0x1000, End: 0x2000}, {Start: 0x8000, End: 0xa000}}); !slices.Equal(k.differ[older], want) {
		t.Errorf("the older zygote's set is %v, want %v", k.differ[older], want)
	}
	if next, ok := k.differ[making]; ok {
		t.Errorf("captured left the next set open (%v)", next)
	}
	// From here on a scan goes into both sets, the closed next set none.
	later := dirty.Set{{Start: 0x20000, End: 0x21000}}
	k.add(later)
	if got := k.differ[newer]; !slices.Equal(got, between.Union(later)) {
		t.Errorf("after a later scan the new zygote's set is %v, want %v", got, between.Union(later))
	}
	if next, ok := k.differ[making]; ok {
		t.Errorf("a closed next set grew: %v", next)
	}
	// A process whose next set was not opened (not scanned by this capture's before)
	// gets no set for the new zygote.
	k2 := &track{differ: map[isolation.Proc]dirty.Set{}}
	ts.procs[43] = k2
	ts.captured(&Record{Procs: []Proc{{Zygote: newer}}}, []int{43})
	if _, ok := k2.differ[newer]; ok {
		t.Error("captured gave a set to a process before did not scan")
	}
}

// TestCapturedRelatesZygotes: a capture records, for its new zygote and each older one
// of the process, the pages in which the two may differ (the process's set for the
// older one then), under both; a process Spawn forks from one of them starts with those
// sets (spawned, through the relation); Forget drops the relations of zygotes that end.
func TestCapturedRelatesZygotes(t *testing.T) {
	self, err := isolation.ProcOf(os.Getpid()) // alive: Forget keeps what is not ending
	if err != nil {
		t.Fatal(err)
	}
	older, newer := self, isolation.Proc{Pid: 1 << 30, StartTime: 2}
	written := dirty.Set{{Start: 0x1000, End: 0x3000}}
	k := &track{differ: map[isolation.Proc]dirty.Set{older: written, making: nil}}
	ts := &Tracks{procs: map[int]*track{42: k}}
	ts.captured(&Record{Procs: []Proc{{Zygote: newer}}}, []int{42})
	for _, p := range [][2]isolation.Proc{{newer, older}, {older, newer}} {
		if got, ok := ts.rel[p[0]][p[1]]; !ok || !slices.Equal(got, written) {
			t.Errorf("relation %v→%v: %v (%v), want %v", p[0], p[1], got, ok, written)
		}
	}
	// Later writes of the process do not change what the two zygotes are.
	k.add(dirty.Set{{Start: 0x9000, End: 0xa000}})
	if got := ts.rel[newer][older]; !slices.Equal(got, written) {
		t.Errorf("a later scan changed the relation: %v, want %v", got, written)
	}
	// The zygote of a second capture relates to both.
	newest := isolation.Proc{Pid: 1<<30 + 1, StartTime: 3}
	k.differ[making] = nil
	ts.captured(&Record{Procs: []Proc{{Zygote: newest}}}, []int{42})
	if got := ts.rel[newest][older]; !slices.Equal(got, written.Union(dirty.Set{{Start: 0x9000, End: 0xa000}})) {
		t.Errorf("relation newest→older: %v", got)
	}
	if got, ok := ts.rel[newest][newer]; !ok || !slices.Equal(got, dirty.Set{{Start: 0x9000, End: 0xa000}}) {
		t.Errorf("relation newest→newer: %v (%v), want the later scan's pages", got, ok)
	}
	// The newest zygote ends: its relations go, under both keys.
	ts.Forget(&Record{Procs: []Proc{{Zygote: newest}}})
	if _, ok := ts.rel[newest]; ok {
		t.Error("Forget kept the relations of an ended zygote")
	}
	if _, ok := ts.rel[older][newest]; ok {
		t.Error("Forget kept a relation to an ended zygote")
	}
}

// TestLaterWaitsForAfter: the scan a rewind leaves for once the processes run again
// begins only once its caller's call has returned (After closed): begun earlier, it
// took a CPU from the end of the rollback (W1, three alternating pairs: the engine's
// commit of the new head over 0.5 ms in 20 % of rollbacks, 7 % with the scan after the
// call). Without After it begins at once.
func TestLaterWaitsForAfter(t *testing.T) {
	began := make(chan []int, 2)
	laterScans = func(pids []int) { began <- pids }
	defer func() { laterScans = nil }()
	ts := &Tracks{}
	after := make(chan struct{})
	ts.mu.Lock()
	ts.later([]int{1}, after)
	ts.mu.Unlock()
	select {
	case <-began:
		t.Fatal("the later scan began before its caller returned")
	case <-time.After(50 * time.Millisecond):
	}
	close(after)
	if got := <-began; !slices.Equal(got, []int{1}) {
		t.Fatalf("the later scan began for %v, want [1]", got)
	}
	ts.mu.Lock()
	ts.later([]int{2}, nil)
	ts.mu.Unlock()
	if got := <-began; !slices.Equal(got, []int{2}) {
		t.Fatalf("the later scan without After began for %v, want [2]", got)
	}
}
