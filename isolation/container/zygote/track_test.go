package zygote

import (
	"slices"
	"testing"

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
