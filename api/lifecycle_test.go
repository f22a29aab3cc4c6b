package api_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// waitEvent reads events until one of type typ (about sandbox id) arrives.
func waitEvent(t testing.TB, es *client.EventStream, id, typ string) *client.Event {
	t.Helper()
	got := make(chan *client.Event, 1)
	errc := make(chan error, 1)
	go func() {
		for {
			ev, err := es.Next()
			if err != nil {
				errc <- err
				return
			}
			if ev.SandboxID == id && ev.Type == typ {
				got <- ev
				return
			}
		}
	}()
	select {
	case ev := <-got:
		return ev
	case err := <-errc:
		t.Fatalf("waiting for %s of %s: %v", typ, id, err)
	case <-time.After(3 * time.Minute):
		t.Fatalf("no %s event for %s within 3 minutes", typ, id)
	}
	return nil
}

// TestTTLAndIdlePause: a sandbox is destroyed or paused when its TTL runs out, per its
// policy; an idle sandbox is paused and the next call resumes it transparently, its
// REPL's state intact.
func TestTTLAndIdlePause(t *testing.T) {
	d := startDaemon(t, nil, "--session-tick", "200ms", "--idle-timeout", "0")
	ctx := context.Background()
	c := d.c
	es, err := c.Events(ctx, client.EventFilter{Labels: map[string]string{"test": "lifecycle"}})
	if err != nil {
		t.Fatal(err)
	}
	defer es.Close()
	labels := map[string]string{"test": "lifecycle"}
	// Idle pause, then transparent resume.
	idle := newSandbox(t, c, client.CreateRequest{Labels: labels, Lifetime: client.Lifetime{IdleTimeoutSeconds: 2}})
	h := repl(t, c, idle.ID)
	send(t, c, idle.ID, h, "x = 41")
	if v := replValue(t, c, idle.ID, h, "x"); v != "41" {
		t.Fatalf("x = %s", v)
	}
	ev := waitEvent(t, es, idle.ID, client.EventPaused)
	if ev.Reason != "idle" || ev.Checkpoint == "" || ev.SessionID != idle.SessionID {
		t.Fatalf("paused event: %+v", ev)
	}
	sb, err := c.Get(ctx, idle.ID)
	if err != nil || sb.State != client.StatePaused || sb.PausedReason != "idle" {
		t.Fatalf("idle sandbox: %v %+v", err, sb)
	}
	if ck, err := c.GetCheckpoint(ctx, ev.Checkpoint); err != nil || ck.Label != "idle-pause" || sb.Head != ck.ID {
		t.Fatalf("pause checkpoint: %v %+v (head %s)", err, ck, sb.Head)
	}
	send(t, c, idle.ID, h, "x += 1") // resumes it
	if v := replValue(t, c, idle.ID, h, "x"); v != "42" {
		t.Fatalf("x after the idle pause = %s, want 42", v)
	}
	if ev := waitEvent(t, es, idle.ID, client.EventResumed); ev.Reason != "activity" {
		t.Fatalf("resumed event: %+v", ev)
	}
	if sb, err := c.Get(ctx, idle.ID); err != nil || sb.State != client.StateRunning {
		t.Fatalf("after resume: %v %+v", err, sb)
	}
	// TTL, policy destroy.
	gone := newSandbox(t, c, client.CreateRequest{Labels: labels, Lifetime: client.Lifetime{TTLSeconds: 2, IdleTimeoutSeconds: -1}})
	waitEvent(t, es, gone.ID, client.EventExpired)
	if ev := waitEvent(t, es, gone.ID, client.EventDestroyed); ev.Reason != "expired" {
		t.Fatalf("destroyed event: %+v", ev)
	}
	if _, err := c.Get(ctx, gone.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("expired sandbox: %v", err)
	}
	// TTL, policy pause: kept, refused until explicitly resumed with a new TTL.
	kept := newSandbox(t, c, client.CreateRequest{Labels: labels, Lifetime: client.Lifetime{TTLSeconds: 2, ExpiryPolicy: "pause", IdleTimeoutSeconds: -1}})
	kh := repl(t, c, kept.ID)
	send(t, c, kept.ID, kh, "y = 7")
	replValue(t, c, kept.ID, kh, "y")
	if ev := waitEvent(t, es, kept.ID, client.EventPaused); ev.Reason != "expired" {
		t.Fatalf("paused event: %+v", ev)
	}
	if _, err := c.Spawn(ctx, kept.ID, client.ExecRequest{Args: []string{"true"}}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("exec in an expired sandbox: %v", err)
	}
	sb, err = c.Resume(ctx, kept.ID)
	if err != nil || sb.State != client.StateRunning || !sb.ExpiresAt.After(time.Now().Add(30*time.Minute)) {
		t.Fatalf("resume of an expired sandbox: %v %+v", err, sb)
	}
	if v := replValue(t, c, kept.ID, kh, "y"); v != "7" {
		t.Fatalf("y after the TTL pause = %s, want 7", v)
	}
}

// TestShutdownPauseAndRestart: with --on-shutdown pause, SIGTERM pauses the running
// sandboxes; after a restart the next call resumes them with their state, and the
// session (TTL, session ID) survived.
func TestShutdownPauseAndRestart(t *testing.T) {
	d := startDaemon(t, nil, "--on-shutdown", "pause")
	ctx := context.Background()
	session := "sess-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	sb := newSandbox(t, d.c, client.CreateRequest{Lifetime: client.Lifetime{SessionID: session, RunID: "run-7", TTLSeconds: 1800}})
	h := repl(t, d.c, sb.ID)
	send(t, d.c, sb.ID, h, "z = 5")
	replValue(t, d.c, sb.ID, h, "z")
	if err := d.stop(); err != nil {
		t.Fatalf("cairnd exit: %v", err)
	}
	d2 := startDaemon(t, nil)
	t.Cleanup(func() { d2.c.Remove(ctx, sb.ID) })
	got, err := d2.c.Get(ctx, sb.ID)
	if err != nil || got.State != client.StatePaused || got.PausedReason != "shutdown" ||
		got.SessionID != session || got.RunID != "run-7" || !got.ExpiresAt.Equal(sb.ExpiresAt) {
		t.Fatalf("after restart: %v %+v (was %+v)", err, got, sb)
	}
	l, err := d2.c.List(ctx, client.ListOptions{Session: session, Run: "run-7"})
	if err != nil || len(l) != 1 || l[0].ID != sb.ID {
		t.Fatalf("list by session and run: %v %+v", err, l)
	}
	send(t, d2.c, sb.ID, h, "z *= 2")
	if v := replValue(t, d2.c, sb.ID, h, "z"); v != "10" {
		t.Fatalf("z after shutdown and restart = %s, want 10", v)
	}
}

// goroutines reads the daemon's go_goroutines metric.
func goroutines(t testing.TB, d *daemon) int {
	t.Helper()
	c := unixHTTP(d.sock)
	// Its connection is not left idle in the daemon, where it would count.
	defer c.CloseIdleConnections()
	resp, err := c.Get("http://cairnd/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Fatal("no go_goroutines in /metrics")
	return 0
}

// TestStreamDisconnect: a client that leaves an exec stream takes its process with it;
// one that leaves an output stream does not; neither leaks goroutines in cairnd.
func TestStreamDisconnect(t *testing.T) {
	d := startDaemon(t, nil)
	c := d.c
	sb := newSandbox(t, c, client.CreateRequest{})
	ctx := context.Background()
	// Warm up connections and lazily started goroutines, then take the baseline.
	c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"true"}}, nil, nil)
	base := goroutines(t, d)
	for i := 0; i < 5; i++ {
		sctx, cancel := context.WithCancel(ctx)
		started := make(chan string, 1)
		done := make(chan error, 1)
		go func() {
			_, err := c.Run(sctx, sb.ID, client.ExecRequest{Args: []string{"sh", "-c", "while :; do echo tick; sleep 0.05; done"}},
				writerFunc(func(p []byte) {
					select {
					case started <- "":
					default:
					}
				}), nil)
			done <- err
		}()
		<-started
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run after cancel: %v", err)
		}
	}
	// Every abandoned process ends (SIGTERM kills sh).
	ps, err := c.Processes(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		if _, err := c.Wait(ctx, sb.ID, p.Handle); err != nil {
			t.Fatalf("wait %s: %v", p.Handle, err)
		}
	}
	// An output stream left: the process keeps running.
	p, err := c.Spawn(ctx, sb.ID, client.ExecRequest{Args: []string{"sleep", "300"}})
	if err != nil {
		t.Fatal(err)
	}
	fctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	_, err = c.Follow(fctx, sb.ID, p.Handle, io.Discard, io.Discard)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("follow: %v", err)
	}
	if q, err := c.Process(ctx, sb.ID, p.Handle); err != nil || !q.Running {
		t.Fatalf("process after its output stream was left: %v %+v", err, q)
	}
	// Idle keep-alive connections hold two goroutines each on the server side; allow
	// them, and wait for the handlers to unwind.
	var now int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if now = goroutines(t, d); now <= base+4 {
			return
		}
	}
	resp, _ := unixHTTP(d.sock).Get("http://cairnd/metrics")
	resp.Body.Close()
	t.Fatalf("cairnd goroutines: %d before the streams, %d after", base, now)
}

type writerFunc func([]byte)

func (f writerFunc) Write(p []byte) (int, error) { f(p); return len(p), nil }

var _ = http.MethodGet
