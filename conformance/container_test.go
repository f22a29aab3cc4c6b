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

// harness runs the suite on the named backend.
func harness(t *testing.T, isolation string) Harness {
	e := testenv.Engine(t)
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

func TestContainer(t *testing.T) {
	Run(t, harness(t, "container"))
}
