package container

import (
	"context"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer/freezertest"
)

// tracerEnv makes the test binary play a CRIU whose caller died (TestMain): given
// "PID:FREEZER", it seizes the process, says "seized" on stdout, and 300 ms later
// freezes the freezer cgroup FREEZER (the state CRIU found) and exits, which lets the
// process go.
const tracerEnv = "CAIRN_TEST_TRACER"

func TestMain(m *testing.M) {
	if v := os.Getenv(tracerEnv); v != "" {
		p, dir, _ := strings.Cut(v, ":")
		pid, _ := strconv.Atoi(p)
		runtime.LockOSThread()
		if err := unix.PtraceSeize(pid); err != nil {
			os.Stderr.WriteString("seize: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Stdout.WriteString("seized")
		time.Sleep(300 * time.Millisecond)
		freezer.Write(dir, freezer.Frozen)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestRecoverWaitsForCRIU plays a checkpoint that died while CRIU was dumping (the order
// of criu/seize.c): the engine froze the sandbox, CRIU seized its process and thawed the
// cgroup; with its caller gone CRIU ends the dump by freezing the cgroup again (the
// state it found) and letting the process go. Recover must leave the sandbox thawed: a
// thaw at once, or as soon as the tracer goes, is undone or too early.
func TestRecoverWaitsForCRIU(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups, ptrace)")
	}
	sb := &isolation.Sandbox{ID: "recover-test", Cgroup: "recover-test-" + strconv.Itoa(os.Getpid())}
	dir := ctrlDir("freezer", sb.CgroupName())
	cmd := freezertest.Sleeper(t, dir)
	if err := freezer.Set(dir, freezer.Frozen); err != nil {
		t.Fatal(err)
	}
	tracer := exec.Command(os.Args[0], "-test.run=^$")
	tracer.Env = append(os.Environ(), tracerEnv+"="+strconv.Itoa(cmd.Process.Pid)+":"+dir)
	tracer.Stderr = os.Stderr
	out, err := tracer.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := tracer.Start(); err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(io.LimitReader(out, 6)); string(b) != "seized" {
		tracer.Wait()
		t.Fatalf("the tracer did not seize the process (%q)", b)
	}
	done := make(chan struct{})
	go func() { tracer.Wait(); close(done) }()
	t.Cleanup(func() { tracer.Process.Kill(); <-done })
	if err := freezer.Set(dir, freezer.Thawed); err != nil { // as CRIU does once it holds the tree
		t.Fatal(err)
	}

	if outsideTracer(sb.CgroupName()) == 0 {
		t.Fatal("the process shows no tracer")
	}
	start := time.Now()
	if err := (&Backend{}).Recover(context.Background(), sb); err != nil {
		t.Fatalf("Recover: %v", err)
	}
	t.Logf("Recover took %v", time.Since(start).Round(time.Millisecond))
	<-done
	if got := freezer.State(dir); got != freezer.Thawed {
		t.Fatalf("after Recover the sandbox is %s, want %s", got, freezer.Thawed)
	}
	if outsideTracer(sb.CgroupName()) != 0 {
		t.Fatal("the process is still traced")
	}

	// Nothing to undo: Recover returns at once and leaves it thawed.
	if err := (&Backend{}).Recover(context.Background(), sb); err != nil || freezer.State(dir) != freezer.Thawed {
		t.Fatalf("Recover of a thawed sandbox: %v, state %s", err, freezer.State(dir))
	}
}

// TestRecoverReleasesHeldCRIU plays a resident checkpoint that died while it held the
// sandbox's background CRIU (frozen in its own cgroup, holdCRIU): Recover lets it go.
// Left frozen, the durable copy it was writing never ended, and a rollback to that
// checkpoint waited for it for good.
func TestRecoverReleasesHeldCRIU(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	sb := &isolation.Sandbox{ID: "recover-criu-test", Cgroup: "recover-criu-test-" + strconv.Itoa(os.Getpid())}
	dir := criuDir(sb.CgroupName())
	freezertest.Sleeper(t, dir)
	release, err := holdCRIU(sb.CgroupName())
	if err != nil {
		t.Fatal(err)
	}
	_ = release // its holder died
	if got := freezer.State(dir); got != freezer.Frozen {
		t.Fatalf("held CRIU: %s, want %s", got, freezer.Frozen)
	}
	if err := (&Backend{}).Recover(context.Background(), sb); err != nil {
		t.Fatalf("Recover: %v", err)
	}
	if got := freezer.State(dir); got != freezer.Thawed {
		t.Fatalf("after Recover the background CRIU is %s, want %s", got, freezer.Thawed)
	}
}

// TestHoldCRIUSoon checks the hold that does not wait: the background CRIU is asked to
// freeze, held waits until it is frozen, release thaws it; with no CRIU running there is
// nothing to hold.
func TestHoldCRIUSoon(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	sb := &isolation.Sandbox{ID: "hold-soon-test", Cgroup: "hold-soon-test-" + strconv.Itoa(os.Getpid())}
	dir := criuDir(sb.CgroupName())
	release, held := holdCRIUSoon(sb.CgroupName())
	if err := held(); err != nil {
		t.Fatalf("held with no CRIU: %v", err)
	}
	release()
	freezertest.Sleeper(t, dir)
	release, held = holdCRIUSoon(sb.CgroupName())
	if got := freezer.State(dir); got != "FREEZING" && got != freezer.Frozen {
		t.Fatalf("asked to hold: %s, want FREEZING or %s", got, freezer.Frozen)
	}
	if err := held(); err != nil {
		t.Fatal(err)
	}
	if got := freezer.State(dir); got != freezer.Frozen {
		t.Fatalf("held: %s, want %s", got, freezer.Frozen)
	}
	release()
	if err := freezer.Wait(dir, freezer.Thawed); err != nil {
		t.Fatalf("released: %v", err)
	}
}
