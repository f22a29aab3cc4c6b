package conformance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

func TestMain(m *testing.M) {
	CrashMain(func() (*engine.Engine, error) {
		cfg := engine.Config{DataDir: testenv.DataDir(), InitBinary: os.Getenv("CAIRN_INIT")}
		cfg.Residents, _ = strconv.Atoi(os.Getenv(residentsEnv))
		return engine.Open(context.Background(), cfg)
	})
	os.Exit(m.Run())
}

// residentsEnv carries Config.Residents to crash-test children.
const residentsEnv = "CAIRN_TEST_RESIDENTS"

// harness runs the suite on the named backend with the default configuration.
func harness(t *testing.T, isolation string) Harness {
	return harnessWith(t, isolation, nil)
}

// harnessWith runs the suite on the named backend with a configuration hook.
func harnessWith(t *testing.T, isolation string, configure func(*engine.Config)) Harness {
	e := testenv.EngineWith(t, configure)
	initBin := testenv.InitBinary(t)
	var cfg engine.Config
	if configure != nil {
		configure(&cfg)
	}
	return Harness{
		Engine:    e,
		Isolation: isolation,
		Resident:  isolation == "container" && cfg.Residents >= 0,
		Rewinds:   isolation == "container" && cfg.Residents >= 0 && !cfg.NoRewinds && zygote.Supported() == nil,
		Reopen: func() (*engine.Engine, error) {
			return engine.Open(context.Background(), engine.Config{DataDir: testenv.DataDir(), InitBinary: initBin})
		},
		Diagnose: func(id string) string { return diagnose(e, id) },
		Crash: func(t *testing.T, sandbox, point string) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), CrashEnv+"="+sandbox+":"+point, "CAIRN_INIT="+initBin,
				residentsEnv+"="+strconv.Itoa(cfg.Residents))
			out, err := cmd.CombinedOutput()
			if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
				t.Fatalf("crash child at %s did not die by signal: %v: %s", point, err, out)
			}
		},
	}
}

// TestContainer runs the suite with the default configuration: checkpoints are kept
// resident (zygotes) where the sandbox allows it, a rollback of the same sandbox forks
// from them, and forks take a standby or restore the durable images.
func TestContainer(t *testing.T) {
	h := harness(t, "container")
	h.Stress = 1000
	Run(t, h)
}

// TestContainerNoRewind runs the suite with resident checkpoints but no rewinds in
// place: every rollback to one kills the processes and forks them from the zygotes.
func TestContainerNoRewind(t *testing.T) {
	Run(t, harnessWith(t, "container", func(c *engine.Config) { c.NoRewinds = true }))
}

// TestContainerNoSplit runs the suite without split snapshots: a checkpoint's
// processes wait, and its call returns, until its filesystem's snapshot is committed,
// not only fixed (storage.SplitSnapshotter).
func TestContainerNoSplit(t *testing.T) {
	Run(t, harnessWith(t, "container", func(c *engine.Config) { c.NoSplitSnapshots = true }))
}

// TestContainerNoStandby runs the suite with every fast path disabled: every checkpoint
// is a CRIU dump, and each rollback and fork a CRIU restore.
func TestContainerNoStandby(t *testing.T) {
	Run(t, harnessWith(t, "container", func(c *engine.Config) { c.Standbys, c.Residents = -1, -1 }))
}

// TestContainerWarm runs the suite with every rollback and fork on the standby path
// (CRIU dumps, no zygotes).
func TestContainerWarm(t *testing.T) {
	h := harnessWith(t, "container", func(c *engine.Config) { c.Residents = -1 })
	h.Warm = true
	Run(t, h)
}

// diagnose describes a container sandbox's processes: its freezer cgroup's state, and
// each task's state and tracer.
func diagnose(e *engine.Engine, id string) string {
	sb, err := e.Get(context.Background(), id)
	if err != nil {
		return err.Error()
	}
	dir := freezer.Of(sb.Init.Pid)
	if dir == "" {
		return fmt.Sprintf("init %d has no freezer cgroup (gone?)", sb.Init.Pid)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "freezer %s %s; tasks:", dir, freezer.State(dir))
	for _, tid := range freezer.Tasks(dir) {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
		var fields []string
		for _, l := range strings.Split(string(st), "\n") {
			for _, k := range []string{"Name:", "State:", "TracerPid:", "SigPnd:", "ShdPnd:", "SigBlk:"} {
				if strings.HasPrefix(l, k) {
					fields = append(fields, strings.Join(strings.Fields(l), " "))
				}
			}
		}
		fmt.Fprintf(&b, " [%d %s]", tid, strings.Join(fields, ", "))
	}
	return b.String()
}

// TestContainerRewindFails makes a rewind fail once it has changed the process's memory:
// the rollback must still bring the checkpoint back, by forking from the zygotes in the
// same generation, so that the sandbox's other resident checkpoints keep theirs.
func TestContainerRewindFails(t *testing.T) {
	h := harness(t, "container")
	if !h.Rewinds {
		t.Skip("this kernel does not rewind processes in place")
	}
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `a = bytearray(4 << 20); a[7] = 1`)
	ck1 := checkpoint(t, h, id, "one")
	ask(t, h, id, p, `a[7] = 2; b = [str(i) for i in range(50000)]`)
	ck2 := checkpoint(t, h, id, "two")
	ask(t, h, id, p, `a[7] = 3; del b`)
	zygote.RewindFault = func() error { return errors.New("a fault injected by the test") }
	defer func() { zygote.RewindFault = nil }()
	want(t, "path of the failing rewind", rollbackPath(t, h, id, ck1), "failed")
	zygote.RewindFault = nil
	state := `print(a[7], "b" in dir() and len(b))`
	want(t, "state after the failed rewind", ask(t, h, id, p, state), "1 False")
	if c, err := h.Engine.GetCheckpoint(context.Background(), ck2); err != nil || !c.Resident {
		t.Fatalf("checkpoint two after the failed rewind: resident %v, %v (%+v)", c != nil && c.Resident, err, h.Engine.Stats())
	}
	rollback(t, h, id, ck2)
	want(t, "state after a rollback to two", ask(t, h, id, p, state), "2 50000")
}
