// Package testenv gives cairn's integration tests a real engine: root, a btrfs pool in a
// shared test data directory, the cairn-init binary built from this tree, and the
// default Debian template (built by debootstrap on first use and then cached there).
//
// Outside CI a missing prerequisite skips the test with the reason; with CI=true it
// fails it, so CI never passes by skipping.
package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
	"github.com/cairn-sandbox/cairn/template"
)

// DataDir is the shared test data directory ($CAIRN_TEST_DATA_DIR or /var/tmp/cairn-test).
func DataDir() string {
	if d := os.Getenv("CAIRN_TEST_DATA_DIR"); d != "" {
		return d
	}
	return "/var/tmp/cairn-test"
}

// Require skips (outside CI) or fails (in CI) unless the prerequisites are met.
func Require(t testing.TB) {
	t.Helper()
	missing := ""
	switch {
	case os.Geteuid() != 0:
		missing = "these tests need root"
	default:
		if _, err := criu.Find(); err != nil {
			missing = err.Error()
		} else if _, err := exec.LookPath("mkfs.btrfs"); err != nil {
			missing = "mkfs.btrfs not found (run scripts/install-deps.sh)"
		}
	}
	if missing != "" {
		prereq.Missing(t, missing)
	}
}

// RepoRoot returns the repository's root directory.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

var (
	buildOnce sync.Once
	initPath  string
	buildErr  error
)

// InitBinary builds cmd/cairn-init once per test process. Every test process shares one
// file (cairn-test-init in the temporary directory): each builds beside it and renames
// its build over it, which a sandbox started from the previous build does not notice (it
// holds the old inode). So test runs, even killed ones, leave one binary, not one each.
func InitBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "cairn-init-")
		if err != nil {
			buildErr = err
			return
		}
		defer os.RemoveAll(dir)
		built := filepath.Join(dir, "cairn-init")
		cmd := exec.Command("go", "build", "-o", built, "./cmd/cairn-init")
		cmd.Dir = RepoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr, initPath = err, string(out)
			return
		}
		initPath = filepath.Join(os.TempDir(), "cairn-test-init")
		buildErr = os.Rename(built, initPath)
	})
	if buildErr != nil {
		t.Fatalf("build cairn-init: %v: %s", buildErr, initPath)
	}
	return initPath
}

// Engine opens an engine on the shared test data directory, with the default template
// present. It is closed at the end of the test.
func Engine(t testing.TB) *engine.Engine {
	return EngineWith(t, nil)
}

// EngineWith is Engine with a configuration hook (nil for none).
func EngineWith(t testing.TB, configure func(*engine.Config)) *engine.Engine {
	t.Helper()
	Require(t)
	ctx := context.Background()
	cfg := Config(t)
	cfg.Progress = template.NewBarProgress(os.Stderr)
	if configure != nil {
		configure(&cfg)
	}
	e, err := engine.Open(ctx, cfg)
	if err != nil {
		t.Fatalf("open engine: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	EnsureTemplate(t, e)
	return e
}

// Config is the engine configuration of the tests. What the engine logs (background
// work's problems, rollbacks that left their fast path and why) is printed with the
// test's output when the test fails.
func Config(t testing.TB) engine.Config {
	l := &engineLog{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("engine log:\n%s", l.text())
		}
	})
	return engine.Config{DataDir: DataDir(), InitBinary: InitBinary(t), Logf: l.printf}
}

// engineLog keeps an engine's log lines; background work may write them after its test
// has ended, which t.Logf does not allow.
type engineLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *engineLog) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, time.Now().Format("15:04:05.000 ")+fmt.Sprintf(format, args...))
}

func (l *engineLog) text() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

var tmplMu sync.Mutex

// EnsureTemplate makes sure the default template exists: debootstrap in CI; outside
// CI a local debootstrap tree in $CAIRN_TEST_ROOTFS is imported instead when given.
func EnsureTemplate(t testing.TB, e *engine.Engine) {
	t.Helper()
	tmplMu.Lock()
	defer tmplMu.Unlock()
	ctx := context.Background()
	ts, err := e.Templates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tm := range ts {
		if tm.Name == engine.DefaultTemplate {
			return
		}
	}
	spec := template.Default()
	if dir := os.Getenv("CAIRN_TEST_ROOTFS"); dir != "" && os.Getenv("CI") != "true" {
		spec = template.Spec{Name: engine.DefaultTemplate, Dir: dir}
	}
	t.Logf("building template %q (first use of %s)", spec.Name, DataDir())
	if _, err := e.BuildTemplate(ctx, spec); err != nil {
		t.Fatalf("build default template: %v", err)
	}
}
