package main

// End-to-end tests of the cairn binary: they build cairn and cairn-init, and drive them
// on the shared test data directory ($CAIRN_TEST_DATA_DIR or /var/tmp/cairn-test).
// Tests needing sandboxes skip without root (or CRIU, btrfs) outside CI and fail in CI.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/internal/testenv"
)

var (
	cairnBin string
	binDir   string
	// extraEnv is added to the environment of every cairn run (CAIRN_URL for the
	// scenario against a live cairnd).
	extraEnv []string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "cairn-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, pkg := range []string{"cairn", "cairn-init", "cairnd"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, pkg), "./cmd/"+pkg)
		cmd.Dir = testenv.RepoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s: %v\n%s", pkg, err, out)
			os.RemoveAll(dir)
			os.Exit(1)
		}
	}
	cairnBin, binDir = filepath.Join(dir, "cairn"), dir
	importLocalTemplate()
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// importLocalTemplate saves the debootstrap of the default template on developer
// machines that name a debootstrap tree in $CAIRN_TEST_ROOTFS (never in CI).
func importLocalTemplate() {
	tree := os.Getenv("CAIRN_TEST_ROOTFS")
	if tree == "" || os.Getenv("CI") == "true" || os.Geteuid() != 0 {
		return
	}
	if st, err := os.Stat(tree); err != nil || !st.IsDir() {
		return
	}
	r := runCairn("", "--json", "template", "ls")
	if r.code != 0 || strings.Contains(r.stdout, `"name": "debian"`) {
		return
	}
	fmt.Fprintf(os.Stderr, "importing template debian from %s\n", tree)
	runCairn("", "template", "import", "debian", "--dir", tree) // a concurrent build may win: fine
}

type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout: %q\nstderr: %q", r.code, r.stdout, r.stderr)
}

// lastLine is the last non-empty line of stdout.
func (r result) lastLine() string {
	lines := r.lines()
	if len(lines) == 0 {
		return ""
	}
	return lines[len(lines)-1]
}

func (r result) lines() []string {
	return strings.Fields(strings.TrimSpace(r.stdout))
}

// runCairn runs the cairn binary on the test data directory.
func runCairn(stdin string, args ...string) result {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, cairnBin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAIRN_POOL_") && !strings.HasPrefix(kv, "CAIRN_DATA_DIR=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "CAIRN_DATA_DIR="+testenv.DataDir())
	cmd.Env = append(cmd.Env, extraEnv...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		r.code, r.stderr = -1, err.Error()
	}
	return r
}

func cairn(t *testing.T, args ...string) result {
	t.Helper()
	return runCairn("", args...)
}

// ok runs cairn and fails the test unless it exits 0.
func ok(t *testing.T, args ...string) result {
	t.Helper()
	r := runCairn("", args...)
	if r.code != 0 {
		t.Fatalf("cairn %s: %s", strings.Join(args, " "), r)
	}
	return r
}

func wantCode(t *testing.T, r result, code int, what string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("%s: want exit %d, got %s", what, code, r)
	}
}

var idRE = regexp.MustCompile(`^[a-z0-9]+$`)

// newSandbox creates a sandbox removed at the end of the test.
func newSandbox(t *testing.T, args ...string) string {
	t.Helper()
	if iso := os.Getenv("CAIRN_TEST_ISOLATION"); iso != "" {
		args = append(args, "--isolation", iso)
	}
	id := ok(t, append([]string{"create"}, args...)...).lastLine()
	if !idRE.MatchString(id) {
		t.Fatalf("create printed %q, not an ID", id)
	}
	t.Cleanup(func() { runCairn("", "rm", id) })
	return id
}

// waitStdout polls a process's stdout until it satisfies ok.
func waitStdout(t *testing.T, id, p string, ok func(string) bool) string {
	t.Helper()
	var last string
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		r := cairn(t, "logs", "--stdout", id, p)
		if r.code != 0 {
			t.Fatalf("logs: %s", r)
		}
		if last = r.stdout; ok(last) {
			return last
		}
	}
	t.Fatalf("stdout of %s never matched; last: %q", p, last)
	return ""
}

// TestScenario is the REPL scenario of the issue, end to end through the binary (the
// engine in process).
func TestScenario(t *testing.T) {
	testenv.Require(t)
	scenario(t)
}

// TestScenarioDaemon is the same scenario with every command going through a live
// cairnd ($CAIRN_URL): same verbs, same output.
func TestScenarioDaemon(t *testing.T) {
	testenv.Require(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "cairnd.sock")
	logf, err := os.Create(filepath.Join(dir, "cairnd.log"))
	if err != nil {
		t.Fatal(err)
	}
	d := exec.Command(filepath.Join(binDir, "cairnd"), "--data-dir", testenv.DataDir(), "--socket", sock)
	d.Stdout, d.Stderr = logf, logf
	// A test binary killed before its cleanup does not leave its cairnd serving.
	d.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Process.Signal(syscall.SIGTERM)
		d.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("cairnd log:\n%s", b)
		}
	})
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("cairnd did not listen within a minute")
		}
	}
	extraEnv = []string{"CAIRN_URL=unix://" + sock}
	t.Cleanup(func() { extraEnv = nil })
	id := scenario(t)
	_ = id
}

// scenario runs the REPL scenario and returns the (removed) sandbox's ID.
func scenario(t *testing.T) string {
	id := newSandbox(t)
	if extraEnv != nil {
		// Through cairnd, sandboxes carry a session.
		var doc struct {
			Sandbox struct {
				SessionID string `json:"session_id"`
			} `json:"sandbox"`
		}
		decodeOne(t, ok(t, "--json", "inspect", id).stdout, &doc)
		if doc.Sandbox.SessionID == "" {
			t.Fatalf("cairn inspect did not go through cairnd (no session)")
		}
	}
	if r := ok(t, "exec", id, "--", "python3", "-c", "print(1)"); r.stdout != "1\n" {
		t.Fatalf("exec print(1): %s", r)
	}
	p := ok(t, "exec", "-d", id, "--", "python3", "-i", "-u").lastLine()
	if !idRE.MatchString(p) {
		t.Fatalf("exec -d printed %q, not a handle", p)
	}
	ok(t, "stdin", id, p, "x = 41")
	c1 := ok(t, "checkpoint", id, "--label", "before").lastLine()
	if !idRE.MatchString(c1) {
		t.Fatalf("checkpoint printed %q, not an ID", c1)
	}
	ok(t, "stdin", id, p, "x += 1")
	ok(t, "exec", id, "--", "rm", "-rf", "/etc/apt")
	wantCode(t, cairn(t, "files", "stat", id, "/etc/apt"), 3, "stat of removed /etc/apt")
	ok(t, "rollback", id, c1)
	ok(t, "exec", id, "--", "test", "-d", "/etc/apt")
	ok(t, "stdin", id, p, "print(x)")
	if got := waitStdout(t, id, p, func(s string) bool { return strings.HasSuffix(s, "\n") }); got != "41\n" {
		t.Fatalf("x after rollback: stdout %q, want \"41\\n\"", got)
	}
	// Foreground execs remove their records (unless --keep); ps --prune the others.
	ok(t, "exec", "--keep", id, "--", "true")
	type proc struct {
		Handle string          `json:"handle"`
		Exit   json.RawMessage `json:"exit"`
	}
	var ps, pruned []proc
	decodeOne(t, ok(t, "--json", "ps", id).stdout, &ps)
	if len(ps) != 2 || ps[0].Handle != p || ps[1].Exit == nil {
		t.Fatalf("ps after foreground execs and one exec --keep: %+v; want the REPL %s and the kept one", ps, p)
	}
	decodeOne(t, ok(t, "--json", "ps", "--prune", id).stdout, &pruned)
	if len(pruned) != 1 || pruned[0].Handle != ps[1].Handle {
		t.Fatalf("ps --prune removed %+v, want %s", pruned, ps[1].Handle)
	}
	decodeOne(t, ok(t, "--json", "ps", id).stdout, &ps)
	if len(ps) != 1 || ps[0].Handle != p {
		t.Fatalf("ps after --prune: %+v, want only the REPL %s", ps, p)
	}
	prewarm(t)
	forks := ok(t, "fork", c1, "--count", "2").lines()
	if len(forks) != 2 || !idRE.MatchString(forks[0]) || !idRE.MatchString(forks[1]) || forks[0] == forks[1] {
		t.Fatalf("fork --count 2 printed %q", forks)
	}
	t.Cleanup(func() { runCairn("", append([]string{"rm"}, forks...)...) })
	// The handle is valid in a fork, and x is 41 there too.
	ok(t, "stdin", forks[1], p, "print(x + 1)")
	waitStdout(t, forks[1], p, func(s string) bool { return s == "42\n" })
	var tree struct {
		Sandbox     string `json:"sandbox"`
		Head        string `json:"head"`
		Checkpoints []struct {
			ID    string `json:"id"`
			Label string `json:"label"`
		} `json:"checkpoints"`
	}
	decodeOne(t, ok(t, "tree", id, "--json").stdout, &tree)
	if tree.Sandbox != id || tree.Head != c1 || len(tree.Checkpoints) != 1 ||
		tree.Checkpoints[0].ID != c1 || tree.Checkpoints[0].Label != "before" {
		t.Fatalf("tree --json: %+v", tree)
	}
	if r := ok(t, "tree", id); !strings.Contains(r.stdout, c1+" *") || !strings.Contains(r.stdout, "before") {
		t.Fatalf("tree does not mark the head: %s", r)
	}
	r := ok(t, append([]string{"rm", id}, forks...)...)
	if got := r.lines(); len(got) != 3 || got[0] != id {
		t.Fatalf("rm printed %q", got)
	}
	wantCode(t, cairn(t, "inspect", id), 3, "inspect removed sandbox")
	return id
}

// prewarm prepares standbys of a container sandbox's checkpoint with cairn prewarm:
// two, then three, which finds the first two still there (in process, they outlive the
// cairn that made them) and tops up.
func prewarm(t *testing.T) {
	t.Helper()
	id := newSandbox(t, "--isolation", "container")
	ck := ok(t, "checkpoint", id).lastLine()
	var doc struct {
		Sandbox struct {
			Isolation string `json:"isolation"`
		} `json:"sandbox"`
	}
	decodeOne(t, ok(t, "--json", "inspect", id).stdout, &doc)
	var pw struct {
		Checkpoint string `json:"checkpoint"`
		Standbys   int    `json:"standbys"`
	}
	decodeOne(t, ok(t, "--json", "prewarm", ck, "-n", "2").stdout, &pw)
	warm := doc.Sandbox.Isolation != "gvisor"
	if pw.Checkpoint != ck || (warm && pw.Standbys < 2) || (!warm && pw.Standbys != 0) {
		t.Fatalf("prewarm --json -n 2 of a %s checkpoint: %+v", doc.Sandbox.Isolation, pw)
	}
	r := ok(t, "prewarm", ck, "-n", "3")
	var got int
	if _, err := fmt.Sscanf(r.stdout, ck+": %d standby(s) ready", &got); err != nil ||
		(warm && got < 3) || (!warm && got != 0) {
		t.Fatalf("prewarm -n 3 after %d standbys (%s): %s", pw.Standbys, doc.Sandbox.Isolation, r)
	}
	if !strings.Contains(r.stderr, "making 3 standby(s) of "+ck+" ready") {
		t.Fatalf("prewarm shows no progress on stderr: %s", r)
	}
	// A rollback takes a standby: the sandbox runs on.
	ok(t, "rollback", id, ck)
	ok(t, "exec", id, "--", "true")
}

// decodeOne parses s as exactly one JSON document.
func decodeOne(t *testing.T, s string, v any) {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	if err := dec.Decode(v); err != nil {
		t.Fatalf("not JSON (%v): %q", err, s)
	}
	var extra any
	if err := dec.Decode(&extra); err != io.EOF {
		t.Fatalf("more than one JSON document (%v): %q", err, s)
	}
}

// TestJSONEverywhere runs every verb with --json and parses its output.
func TestJSONEverywhere(t *testing.T) {
	testenv.Require(t)
	var sb struct{ ID string }
	decodeOne(t, ok(t, "--json", "create", "--label", "test=cli-json").stdout, &sb)
	id := sb.ID
	t.Cleanup(func() { runCairn("", "rm", id) })
	var proc struct{ Handle string }
	decodeOne(t, ok(t, "--json", "exec", "-d", id, "--", "python3", "-i", "-u").stdout, &proc)
	p := proc.Handle
	var ck1, ck2 struct{ ID string }
	decodeOne(t, ok(t, "--json", "checkpoint", id).stdout, &ck1)
	ok(t, "exec", id, "--", "touch", "/workspace/new")
	decodeOne(t, ok(t, "--json", "checkpoint", id, "--label", "two").stdout, &ck2)
	var fk []struct{ ID string }
	decodeOne(t, ok(t, "--json", "fork", ck1.ID).stdout, &fk)
	if len(fk) != 1 {
		t.Fatalf("fork --json: %+v", fk)
	}
	t.Cleanup(func() { runCairn("", "rm", fk[0].ID) })
	var changes []struct{ Kind, Path string }
	decodeOne(t, ok(t, "--json", "diff", ck1.ID, ck2.ID).stdout, &changes)
	added := false
	for _, c := range changes {
		added = added || (c.Kind == "added" && c.Path == "/workspace/new")
	}
	if !added {
		t.Fatalf("diff --json does not list /workspace/new as added: %+v", changes)
	}
	if r := ok(t, "diff", ck1.ID, ck2.ID); !strings.Contains(r.stdout, "A /workspace/new\n") {
		t.Fatalf("diff: %s", r)
	}
	verbs := [][]string{
		{"exec", id, "--", "true"}, {"stdin", id, p, "1"}, {"rollback", id, ck2.ID},
		{"tree", id}, {"ls"}, {"ls", "--label", "test=cli-json"}, {"inspect", id}, {"inspect", ck1.ID},
		{"template", "ls"}, {"ps", id}, {"logs", id, p}, {"files", "write", id, "/workspace/f"},
		{"files", "cat", id, "/workspace/f"}, {"files", "ls", id, "/workspace"},
		{"files", "stat", id, "/workspace/f"}, {"files", "rm", id, "/workspace/f"},
		{"kill", "--signal", "KILL", id, p}, {"ckpt", "ls", id}, {"ckpt", "inspect", ck1.ID},
		{"stop", fk[0].ID}, {"rm", fk[0].ID}, {"ckpt", "rm", ck2.ID}, {"gc"},
	}
	for _, v := range verbs {
		var doc any
		decodeOne(t, ok(t, append([]string{"--json"}, v...)...).stdout, &doc)
	}
	// Errors are JSON too.
	var e struct {
		Error struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	r := cairn(t, "--json", "inspect", "nosuchsandbox0")
	wantCode(t, r, 3, "inspect unknown --json")
	decodeOne(t, r.stdout, &e)
	if e.Error.Code != "not_found" || !strings.Contains(e.Error.Message, "nosuchsandbox0") {
		t.Fatalf("error JSON: %+v", e)
	}
	// prewarm: the ready count on container; gvisor has no standbys, and says so in JSON.
	var doc struct {
		Sandbox struct {
			Isolation string `json:"isolation"`
		} `json:"sandbox"`
	}
	decodeOne(t, ok(t, "--json", "inspect", id).stdout, &doc)
	if doc.Sandbox.Isolation != "gvisor" {
		var pw any
		decodeOne(t, ok(t, "--json", "prewarm", ck1.ID).stdout, &pw)
		return
	}
	r = cairn(t, "--json", "prewarm", ck1.ID)
	wantCode(t, r, 5, "prewarm of a gvisor checkpoint --json")
	decodeOne(t, r.stdout, &e)
	if e.Error.Code != "failed_precondition" || !strings.Contains(e.Error.Message, "no standbys") {
		t.Fatalf("prewarm error JSON: %+v", e)
	}
}

func TestExitCodePassthrough(t *testing.T) {
	testenv.Require(t)
	id := newSandbox(t)
	wantCode(t, cairn(t, "exec", id, "--", "sh", "-c", "exit 7"), 7, "exec exit 7")
	r := cairn(t, "--json", "exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
	wantCode(t, r, 7, "exec --json exit 7")
	var doc struct {
		Handle   string `json:"handle"`
		ExitCode int    `json:"exit_code"`
		Stdout   string `json:"stdout"`
		Stderr   string `json:"stderr"`
	}
	decodeOne(t, r.stdout, &doc)
	if doc.ExitCode != 7 || doc.Stdout != "out\n" || doc.Stderr != "err\n" || doc.Handle == "" {
		t.Fatalf("exec --json: %+v", doc)
	}
	if r := runCairn("print(6*7)\n", "exec", "-i", id, "--", "python3"); r.code != 0 || r.stdout != "42\n" {
		t.Fatalf("exec -i: %s", r)
	}
}

func TestBadInput(t *testing.T) {
	// Usage errors need no engine.
	for _, args := range [][]string{{"exec"}, {"fork"}, {"ls", "--bogus"}, {"nosuchverb"}, {"rollback", "a"}, {"template", "nosuch"}, {"prewarm"}, {"prewarm", "a", "b"}} {
		r := cairn(t, args...)
		wantCode(t, r, 2, "cairn "+strings.Join(args, " "))
		if !strings.HasPrefix(r.stderr, "cairn: ") {
			t.Fatalf("cairn %v: stderr %q does not start with \"cairn: \"", args, r.stderr)
		}
	}
	testenv.Require(t)
	r := cairn(t, "inspect", "nosuchsandbox0")
	wantCode(t, r, 3, "inspect unknown ID")
	if !strings.Contains(r.stderr, "nosuchsandbox0") {
		t.Fatalf("message does not name the ID: %s", r)
	}
	wantCode(t, cairn(t, "exec", "nosuchsandbox0", "--", "true"), 3, "exec in unknown sandbox")
	wantCode(t, cairn(t, "fork", "nosuchckpt0", "--count", "0"), 2, "fork --count 0")
	wantCode(t, cairn(t, "prewarm", "nosuchckpt0", "-n", "0"), 2, "prewarm -n 0")
	wantCode(t, cairn(t, "prewarm", "nosuchckpt0", "-n", "257"), 2, "prewarm -n 257")
	wantCode(t, cairn(t, "prewarm", "nosuchckpt0"), 3, "prewarm of an unknown checkpoint")
	wantCode(t, cairn(t, "inspect", "Not-An-ID"), 2, "malformed ID")
	wantCode(t, cairn(t, "create", "--memory", "lots"), 2, "bad --memory")
}

// TestHelp checks that every command has a Long description and examples, and that
// --help works for it.
func TestHelp(t *testing.T) {
	var walk func(c *cobra.Command, path []string)
	walk = func(c *cobra.Command, path []string) {
		for _, sub := range c.Commands() {
			p := append(append([]string{}, path...), sub.Name())
			if sub.Long == "" || sub.Example == "" {
				t.Errorf("cairn %s: missing Long or Example", strings.Join(p, " "))
			}
			r := cairn(t, append(p, "--help")...)
			if r.code != 0 || !strings.Contains(r.stdout, "Usage:") || !strings.Contains(r.stdout, "Examples:") {
				t.Errorf("cairn %s --help: %s", strings.Join(p, " "), r)
			}
			walk(sub, p)
		}
	}
	walk(newRootCmd(&app{}), nil)
	if r := cairn(t, "--help"); r.code != 0 || !strings.Contains(r.stdout, "Exit codes:") {
		t.Errorf("cairn --help: %s", r)
	}
}
