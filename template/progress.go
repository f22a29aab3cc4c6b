package template

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"

	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/sys/unix"
)

// Progress receives a build's progress. Calls come from one goroutine at a time.
type Progress interface {
	// Stage announces a new phase ("retrieving", "unpacking", "copying", "layer 2/3"...).
	Stage(name string)
	// Advance reports done out of total units; total may grow as the build learns more
	// and is 0 while unknown.
	Advance(done, total int64)
	// Log passes one line of tool output (debootstrap's), for verbose displays.
	Log(line string)
}

type nop struct{}

func (nop) Stage(string)         {}
func (nop) Advance(int64, int64) {}
func (nop) Log(string)           {}

// Nop returns a Progress that discards everything.
func Nop() Progress { return nop{} }

// BarProgress draws a progress bar when its output is a terminal and prints one plain
// line per stage otherwise (logs, CI). Call Close when the build returns.
type BarProgress struct {
	mu    sync.Mutex
	w     io.Writer
	stage string
	last  string // latest Log line, shown after the bar on terminals
	p     *mpb.Progress
	bar   *mpb.Bar
}

// NewBarProgress returns a BarProgress writing to w (os.Stderr if nil).
func NewBarProgress(w io.Writer) *BarProgress {
	if w == nil {
		w = os.Stderr
	}
	bp := &BarProgress{w: w}
	if isTerminal(w) {
		bp.p = mpb.New(mpb.WithOutput(w), mpb.WithWidth(40))
		// Total 0 keeps the bar from completing on its own while the total is an estimate;
		// Close completes it.
		bp.bar = bp.p.AddBar(0,
			mpb.PrependDecorators(decor.Any(func(decor.Statistics) string { return bp.get(&bp.stage, 14) }, decor.WCSyncSpaceR)),
			mpb.AppendDecorators(decor.Percentage(decor.WCSyncSpace),
				decor.Any(func(decor.Statistics) string { return " " + bp.get(&bp.last, 50) })),
		)
	}
	return bp
}

func (bp *BarProgress) get(s *string, width int) string {
	bp.mu.Lock()
	defer bp.mu.Unlock()
	v := *s
	if len(v) > width {
		v = v[:width-1] + "…"
	}
	return v
}

// Stage implements Progress.
func (bp *BarProgress) Stage(name string) {
	bp.mu.Lock()
	bp.stage = name
	bp.mu.Unlock()
	if bp.bar == nil {
		fmt.Fprintf(bp.w, "template: %s\n", name)
	}
}

// Advance implements Progress.
func (bp *BarProgress) Advance(done, total int64) {
	if bp.bar == nil {
		return
	}
	if total > 0 {
		bp.bar.SetTotal(total, false)
	}
	bp.bar.SetCurrent(done)
}

// Log implements Progress. Only terminals show it (as a trailing hint), since plain
// output would drown the stage lines in hundreds of debootstrap lines.
func (bp *BarProgress) Log(line string) {
	bp.mu.Lock()
	bp.last = strings.TrimSpace(line)
	bp.mu.Unlock()
}

// Close finishes the bar (completing it when ok) and waits for the last redraw.
func (bp *BarProgress) Close(ok bool) {
	if bp.bar == nil {
		return
	}
	if ok {
		bp.mu.Lock()
		bp.stage, bp.last = "done", ""
		bp.mu.Unlock()
		bp.bar.SetTotal(-1, true)
	} else {
		bp.bar.Abort(false)
	}
	bp.p.Wait()
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	// A terminal that reports no width (a bare pty) would get an empty bar from mpb:
	// treat it as plain output.
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	return err == nil && ws.Col > 0
}
