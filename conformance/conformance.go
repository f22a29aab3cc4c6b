// Package conformance is the behavioural test suite every isolation backend passes:
// the same test code, parameterized by backend. It drives a real engine (real CRIU,
// real btrfs, real processes) through the scenarios a coding agent lives through —
// a REPL's memory, a database with an open transaction, a loopback client and server,
// threads, forks that diverge, random rollbacks, a crash in the middle of a
// checkpoint — and through bad input.
package conformance

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
)

// Harness is what a backend's test gives the suite.
type Harness struct {
	Engine    *engine.Engine
	Isolation string
	// Crash runs a checkpoint of sandbox in a separate process that dies at point (see
	// CrashMain), and returns when it has died.
	Crash func(t *testing.T, sandbox, point string)
	// Reopen opens a second engine on the same data directory, as a restarted cairn.
	Reopen func() (*engine.Engine, error)
	// Stress is how many rollbacks ManyRollbacks does (default 50).
	Stress int
	// Warm makes every rollback and fork take the standby fast path: after each
	// checkpoint, rollback and fork the suite waits for standbys to be ready.
	Warm bool
	// Resident says that the engine keeps checkpoints resident (zygotes) where it can:
	// every rollback to a resident checkpoint of the same sandbox must then take that
	// path, and the crash tests die at its points.
	Resident bool
	// Rewinds says that the backend brings a resident checkpoint's processes back in
	// place where it can (a rewind: no kill, no fork), which Rewind checks.
	Rewinds bool
	// Diagnose, if set, describes a sandbox's processes as the backend sees them
	// (frozen? stopped? traced?), for the message of a test that found it unresponsive.
	Diagnose func(id string) string
}

// Run runs the whole suite.
func Run(t *testing.T, h Harness) {
	tests := []struct {
		name string
		fn   func(*testing.T, Harness)
	}{
		{"REPLRollback", testREPLRollback},
		{"SQLiteOpenTransaction", testSQLite},
		{"LoopbackServer", testLoopback},
		{"Threads", testThreads},
		{"ForkDiverges", testForkDiverges},
		{"RandomRollbacks", testRandomRollbacks},
		{"CrashMidCheckpoint", testCrash},
		{"BadInput", testBadInput},
		{"Pty", testPty},
		{"Files", testFiles},
		{"TreeDiffDelete", testTreeDiffDelete},
		{"StoppedAndResume", testResume},
		{"ExecSemantics", testExec},
		{"Escape", testEscape},
		{"FileOffset", testFileOffset},
		{"PipeBuffer", testPipeBuffer},
		{"LateChild", testLateChild},
		{"ManyRollbacks", testManyRollbacks},
		{"ResidentPaths", testResidentPaths},
		{"PidHeld", testPidHeld},
		{"SpawnFails", testSpawnFails},
		{"CrashMidRollback", testCrashRollback},
		{"ZygotesSealed", testZygotesSealed},
		{"Rewind", testRewind},
		{"CrashMidRewind", testCrashRewind},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, h) })
	}
}

// sandbox creates a sandbox removed at the end of the test.
func sandbox(t *testing.T, h Harness) string {
	t.Helper()
	ctx := context.Background()
	sb, err := h.Engine.Create(ctx, model.CreateOptions{Isolation: h.Isolation})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { h.Engine.Remove(context.Background(), sb.ID) })
	return sb.ID
}

// replSandbox creates a sandbox (removed when the test ends) running a Python REPL
// (python3 -i -u, for ask), and returns both.
func replSandbox(t *testing.T, h Harness) (id, repl string) {
	t.Helper()
	id = sandbox(t, h)
	return id, spawn(t, h, id, "python3", "-i", "-u")
}

// run runs a command to completion and returns its exit code and output.
func run(t *testing.T, h Harness, id string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := h.Engine.Exec(ctx, id, model.ExecOptions{Args: args, NoStdin: true})
	if err != nil {
		t.Fatalf("exec %v: %v", args, err)
	}
	var out, errb strings.Builder
	st, err := h.Engine.Follow(ctx, id, p, &out, &errb)
	if err != nil {
		t.Fatalf("wait %v: %v", args, err)
	}
	// As cairn's foreground execs do.
	if err := h.Engine.RemoveProcess(ctx, id, p); err != nil {
		t.Fatalf("remove the record of %v: %v", args, err)
	}
	return st.Code, out.String(), errb.String()
}

// sh runs a shell command that must succeed and returns its stdout.
func sh(t *testing.T, h Harness, id, script string) string {
	t.Helper()
	code, out, errOut := run(t, h, id, "sh", "-c", script)
	if code != 0 {
		t.Fatalf("sh -c %q: exit %d: %s", script, code, errOut)
	}
	return out
}

// spawn starts a long-lived process with stdin.
func spawn(t *testing.T, h Harness, id string, args ...string) string {
	t.Helper()
	p, err := h.Engine.Exec(context.Background(), id, model.ExecOptions{Args: args})
	if err != nil {
		t.Fatalf("spawn %v: %v", args, err)
	}
	return p
}

var markerSeq int

// ask sends Python code to a REPL (python3 -i -u) and returns what it printed up to a
// fresh marker. Output since the last ask is ignored, so it works across rollbacks.
func ask(t *testing.T, h Harness, id, p, code string) string {
	t.Helper()
	out, err := tell(context.Background(), h.Engine, id, p, code)
	if err != nil {
		diag := ""
		if h.Diagnose != nil {
			diag = "; " + h.Diagnose(id)
		}
		t.Fatalf("%v%s", err, diag)
	}
	return out
}

// tell is ask without a test: a crash-test child talks to the REPL through its own
// engine.
func tell(ctx context.Context, e *engine.Engine, id, p, code string) (string, error) {
	markerSeq++
	marker := fmt.Sprintf("@@cairn-%d-%d@@", time.Now().UnixNano(), markerSeq)
	_, off, err := e.Output(ctx, id, p, "stdout", 0)
	if err != nil {
		return "", fmt.Errorf("output: %w", err)
	}
	if err := e.Stdin(ctx, id, p, []byte(code+"\n\nprint("+fmt.Sprintf("%q", marker)+")\n"), false); err != nil {
		return "", fmt.Errorf("stdin: %w", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	var got strings.Builder
	for time.Now().Before(deadline) {
		b, next, err := e.Output(ctx, id, p, "stdout", off)
		if err != nil {
			return "", fmt.Errorf("output: %w", err)
		}
		got.Write(b)
		off = next
		if i := strings.Index(got.String(), marker); i >= 0 {
			return strings.TrimSpace(got.String()[:i]), nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	errb, _, _ := e.Output(ctx, id, p, "stderr", 0)
	return "", fmt.Errorf("REPL did not answer %q; stdout so far %q; stderr %q", code, got.String(), tail(string(errb), 500))
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func checkpoint(t *testing.T, h Harness, id, label string) string {
	t.Helper()
	ck, err := h.Engine.Checkpoint(context.Background(), id, engine.CheckpointOptions{Label: label})
	if err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	h.settle()
	return ck.ID
}

func rollback(t *testing.T, h Harness, id, ck string) {
	t.Helper()
	before := h.Engine.Stats()
	resident := false
	if h.Resident {
		c, err := h.Engine.GetCheckpoint(context.Background(), ck)
		resident = err == nil && c.Resident && c.SandboxID == id
	}
	if err := h.Engine.Rollback(context.Background(), id, ck); err != nil {
		t.Fatalf("rollback to %s: %v", ck, err)
	}
	if h.Warm && h.Engine.Stats().StandbysClaimed != before.StandbysClaimed+1 {
		t.Fatalf("warm rollback to %s did not take the standby path: %+v", ck, h.Engine.Stats())
	}
	if resident && h.Engine.Stats().ResidentRollbacks != before.ResidentRollbacks+1 {
		t.Fatalf("rollback to resident checkpoint %s did not go through its zygotes: %+v", ck, h.Engine.Stats())
	}
	h.settle()
}

func fork(t *testing.T, h Harness, ck string, n int) []string {
	t.Helper()
	if h.Warm && n > 1 {
		if err := h.Engine.Prewarm(context.Background(), ck, n); err != nil {
			t.Fatalf("prewarm: %v", err)
		}
	}
	sbs, err := h.Engine.Fork(context.Background(), ck, n)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	h.settle()
	ids := make([]string, len(sbs))
	for i, sb := range sbs {
		ids[i] = sb.ID
		t.Cleanup(func() { h.Engine.Remove(context.Background(), sb.ID) })
	}
	return ids
}

func want(t *testing.T, what, got, want string) {
	t.Helper()
	if got != want {
		t.Fatalf("%s = %q, want %q", what, got, want)
	}
}

// settle waits for standbys in a warm harness.
func (h Harness) settle() {
	if h.Warm {
		h.Engine.Quiesce()
	}
}
