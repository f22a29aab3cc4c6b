package api_test

// Tests of cairnd as users run it: real cairnd processes (built in TestMain) on the
// shared test data directory, driven through the Go client. Tests needing sandboxes
// skip without root (or CRIU, btrfs) outside CI and fail in CI.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "cairnd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, pkg := range []string{"cairnd", "cairn-init"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, pkg), "./cmd/"+pkg)
		cmd.Dir = testenv.RepoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s: %v\n%s", pkg, err, out)
			os.RemoveAll(dir)
			os.Exit(1)
		}
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemon is a cairnd process of a test.
type daemon struct {
	t    testing.TB
	cmd  *exec.Cmd
	sock string
	c    *client.Client
	log  *os.File
	exit chan error
}

// startDaemon runs cairnd on the test data directory with its own socket, and waits
// until it serves. It is stopped (SIGTERM) at the end of the test.
func startDaemon(t testing.TB, env []string, args ...string) *daemon {
	t.Helper()
	testenv.Require(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "cairnd.sock")
	logf, err := os.Create(filepath.Join(dir, "cairnd.log"))
	if err != nil {
		t.Fatal(err)
	}
	args = append([]string{"--data-dir", testenv.DataDir(), "--socket", sock}, args...)
	cmd := exec.Command(filepath.Join(binDir, "cairnd"), args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// A test binary killed before its cleanup does not leave its cairnd serving.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &daemon{t: t, cmd: cmd, sock: sock, c: client.New("unix://"+sock, ""), log: logf, exit: make(chan error, 1)}
	go func() { d.exit <- cmd.Wait() }()
	t.Cleanup(func() { d.stop(); d.dumpLogOnFailure() })
	ctx := context.Background()
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, err := d.c.Health(ctx); err == nil {
			break
		}
		select {
		case err := <-d.exit:
			d.exit <- err
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("cairnd exited at start (%v):\n%s", err, b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("cairnd did not serve within 5 minutes")
		}
	}
	ensureTemplate(t, d.c)
	return d
}

// stop sends SIGTERM and waits for the daemon to exit; it returns the exit error.
func (d *daemon) stop() error {
	if d.cmd.ProcessState != nil {
		return nil
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-d.exit:
		d.exit <- err
		return err
	case <-time.After(2 * time.Minute):
		d.cmd.Process.Kill()
		d.t.Errorf("cairnd did not stop within 2 minutes of SIGTERM")
		return <-d.exit
	}
}

func (d *daemon) dumpLogOnFailure() {
	if d.t.Failed() {
		b, _ := os.ReadFile(d.log.Name())
		d.t.Logf("cairnd log:\n%s", b)
	}
	d.log.Close()
}

// procStats reads the daemon's resident memory (KiB) and open descriptors.
func (d *daemon) procStats() (rssKiB, fds int) {
	pid := d.cmd.Process.Pid
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
				rssKiB, _ = strconv.Atoi(strings.Fields(v)[0])
			}
		}
		f.Close()
	}
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return rssKiB, len(ents)
}

// ensureTemplate imports the default template from $CAIRN_TEST_ROOTFS outside CI when
// it is missing (in CI the first create builds it with debootstrap).
func ensureTemplate(t testing.TB, c *client.Client) {
	t.Helper()
	ctx := context.Background()
	ts, err := c.Templates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tm := range ts {
		if tm.Name == "debian" {
			return
		}
	}
	if dir := os.Getenv("CAIRN_TEST_ROOTFS"); dir != "" && os.Getenv("CI") != "true" {
		if _, err := c.BuildTemplate(ctx, client.TemplateRequest{Name: "debian", Dir: dir}); err != nil {
			t.Logf("import template: %v", err)
		}
	}
}

// newSandbox creates a sandbox removed at the end of the test, with the isolation
// backend of $CAIRN_TEST_ISOLATION (default: the engine's default).
func newSandbox(t testing.TB, c *client.Client, req client.CreateRequest) *client.Sandbox {
	t.Helper()
	if req.Isolation == "" {
		req.Isolation = os.Getenv("CAIRN_TEST_ISOLATION")
	}
	sb, err := c.Create(context.Background(), req)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { c.Remove(context.Background(), sb.ID) })
	return sb
}

// repl starts a Python REPL in a sandbox and returns its handle.
func repl(t testing.TB, c *client.Client, id string) string {
	t.Helper()
	p, err := c.Spawn(context.Background(), id, client.ExecRequest{Args: []string{"python3", "-i", "-u"}})
	if err != nil {
		t.Fatalf("spawn repl: %v", err)
	}
	return p.Handle
}

// send writes a line to the REPL.
func send(t testing.TB, c *client.Client, id, h, line string) {
	t.Helper()
	if err := c.Stdin(context.Background(), id, h, []byte(line+"\n"), false); err != nil {
		t.Fatalf("stdin %q: %v", line, err)
	}
}

var tokenSeq int

// replValue has the REPL write expr to a file with a fresh token, and reads it back
// through the files API once the REPL has run it.
func replValue(t testing.TB, c *client.Client, id, h, expr string) string {
	t.Helper()
	tokenSeq++
	tok := fmt.Sprintf("t%d-%d", os.Getpid(), tokenSeq)
	send(t, c, id, h, fmt.Sprintf("open('/tmp/.v', 'w').write('%s ' + str(%s))", tok, expr))
	ctx := context.Background()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, err := c.ReadFile(ctx, id, "/tmp/.v")
		if v, ok := strings.CutPrefix(string(b), tok+" "); err == nil && ok {
			return v
		}
	}
	t.Fatalf("the REPL of %s never evaluated %s", id, expr)
	return ""
}

func errorsIs(err, target error) bool { return err != nil && errors.Is(err, target) }
