package conformance

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"testing"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv"
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
		Reopen: func() (*engine.Engine, error) {
			return engine.Open(context.Background(), engine.Config{DataDir: testenv.DataDir(), InitBinary: initBin})
		},
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
