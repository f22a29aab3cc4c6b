package container

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

// recoverWait bounds how long Recover waits for the CRIU of a dead checkpoint.
const recoverWait = 30 * time.Second

// Recover implements the engine's Recoverer: it thaws a sandbox that a checkpoint which
// died between its freeze and its thaw left frozen.
//
// If the checkpoint died while CRIU was dumping the tree, that CRIU still holds the
// processes (ptrace; the freezer reads THAWED meanwhile, as CRIU thaws the cgroup once it
// has seized them) and ends its dump on its own once it finds its caller gone: it puts
// the freezer back the way it found it, frozen, then lets the processes go. A thaw
// before that would be undone and the sandbox would stay frozen for good. So Recover
// first waits until every process tracing a task of the sandbox from outside it has
// exited (a debugger inside the sandbox is the sandbox's business), then thaws until the
// state holds for 100 ms. A sandbox with nothing to undo costs a read of its tasks.
//
// A resident checkpoint or rollback that died also left frozen the sandbox's background
// CRIU (a durable copy dumping a zygote from inside), which it held (holdCRIU) so that
// nothing took a PID or wrote in the root meanwhile: that CRIU never ended, and whatever
// waited for its durable copy (a rollback to that checkpoint) waited for good. Recover
// runs under the sandbox's lock, which every holder keeps until it lets CRIU go, so a
// frozen CRIU found then has no holder left: it is thawed.
func (b *Backend) Recover(ctx context.Context, sb *isolation.Sandbox) error {
	cg := sb.CgroupName()
	if crius := criuDir(cg); freezer.State(crius) == freezer.Frozen {
		if err := freezer.Set(crius, freezer.Thawed); err != nil {
			return fmt.Errorf("sandbox %s: let its background CRIU go: %w", sb.ID, err)
		}
	}
	dir := ctrlDir("freezer", cg)
	deadline := time.Now().Add(recoverWait)
	// until polls every 10 ms until done; holder names what it waits for.
	until := func(done func() bool, holder int) error {
		for !done() {
			if time.Now().After(deadline) {
				return errdefs.Unavailable("sandbox %s stays frozen: process %d (the CRIU of a checkpoint that died) still holds it after %s; once it has exited, restart cairn, which thaws the sandbox", sb.ID, holder, recoverWait)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		return nil
	}
	for tracer := outsideTracer(cg); tracer != 0; tracer = outsideTracer(cg) {
		if err := until(func() bool { return !isolation.ProcAlive(tracer) }, tracer); err != nil {
			return err
		}
	}
	if st := freezer.State(dir); st != freezer.Frozen && st != "FREEZING" {
		return nil // thawed, or no cgroup (a stopped sandbox)
	}
	held := 0 // polls in a row that found it thawed
	return until(func() bool {
		if freezer.State(dir) == freezer.Thawed {
			held++
		} else {
			held = 0
			freezer.Write(dir, freezer.Thawed)
		}
		return held == 10
	}, 0)
}

// outsideTracer returns the PID of a process outside the cgroup that traces a task of
// it, or 0.
func outsideTracer(cgroup string) int {
	tasks := cgroupTasks(cgroup)
	for _, tid := range tasks {
		if pid, _ := zygote.Tracer(tid); pid != 0 && !slices.Contains(tasks, pid) {
			return pid
		}
	}
	return 0
}
