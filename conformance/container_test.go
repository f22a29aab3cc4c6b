package conformance

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

func TestMain(m *testing.M) {
	CrashMain(func() (*engine.Engine, error) {
		return engine.Open(context.Background(), engine.Config{DataDir: testenv.DataDir(), InitBinary: os.Getenv("CAIRN_INIT")})
	})
	os.Exit(m.Run())
}

// harness runs the suite on the named backend with the default configuration.
func harness(t *testing.T, isolation string) Harness {
	return harnessWith(t, isolation, nil)
}

// harnessWith runs the suite on the named backend with a configuration hook.
func harnessWith(t *testing.T, isolation string, configure func(*engine.Config)) Harness {
	e := testenv.EngineWith(t, configure)
	initBin := testenv.InitBinary(t)
	return Harness{
		Engine:    e,
		Isolation: isolation,
		Reopen: func() (*engine.Engine, error) {
			return engine.Open(context.Background(), engine.Config{DataDir: testenv.DataDir(), InitBinary: initBin})
		},
		Crash: func(t *testing.T, sandbox, point string) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), CrashEnv+"="+sandbox+":"+point, "CAIRN_INIT="+initBin)
			out, err := cmd.CombinedOutput()
			if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
				t.Fatalf("crash child at %s did not die by signal: %v: %s", point, err, out)
			}
		},
	}
}

// TestContainer runs the suite with the default configuration: standbys are prepared
// in the background, and each rollback or fork takes whichever path is ready.
func TestContainer(t *testing.T) {
	h := harness(t, "container")
	h.Stress = 1000
	Run(t, h)
}

// TestContainerNoStandby runs the suite with every fast path disabled: each rollback
// and fork is a CRIU restore.
func TestContainerNoStandby(t *testing.T) {
	Run(t, harnessWith(t, "container", func(c *engine.Config) { c.Standbys = -1 }))
}

// TestContainerWarm runs the suite with every rollback and fork on the standby path.
func TestContainerWarm(t *testing.T) {
	h := harness(t, "container")
	h.Warm = true
	Run(t, h)
}
