package api_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/client"
)

// loadResult is what a load run measured.
type loadResult struct {
	ops                    int // checkpoints + rollbacks
	elapsed                time.Duration
	rssBefore, rssAfter    int // KiB
	fdsBefore, fdsAfter    int
	goroutinesBefore, gAft int
}

// runLoad drives sandboxes × cycles checkpoint/rollback cycles from clients concurrent
// clients (each its own connections). Every cycle sets x in a REPL, checkpoints, changes
// x, rolls back and checks x came back.
func runLoad(t testing.TB, d *daemon, sandboxes, cycles, clients int) loadResult {
	ctx := context.Background()
	ids := make([]string, sandboxes)
	handles := make([]string, sandboxes)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var errs []error
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	// Measured before the sandboxes exist and after they are removed: what a sandbox
	// holds while it lives (zygotes' helpers, a CRIU worker ready for its next dump, a
	// durable copy in flight) must be released with it, and nothing else may grow.
	var res loadResult
	d.c.Close()
	res.rssBefore, res.fdsBefore = d.procStats()
	res.goroutinesBefore = goroutines(t, d)
	for i := range ids {
		sb := newSandbox(t, d.c, client.CreateRequest{Labels: map[string]string{"test": "load"}})
		ids[i], handles[i] = sb.ID, repl(t, d.c, sb.ID)
	}
	start := time.Now()
	for w := 0; w < clients; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			c := client.New("unix://"+d.sock, "")
			defer c.Close()
			for k := 0; k < cycles; k++ {
				for i := w; i < sandboxes; i += clients {
					if err := cycle(ctx, c, ids[i], handles[i], k); err != nil {
						fail(fmt.Errorf("sandbox %s cycle %d: %w", ids[i], k, err))
						return
					}
				}
			}
		}(w)
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.ops = 2 * sandboxes * cycles
	for _, err := range errs {
		t.Error(err)
	}
	for _, id := range ids {
		if err := d.c.Remove(ctx, id); err != nil {
			t.Errorf("remove %s: %v", id, err)
		}
	}
	// Idle connections, handlers and background work (durable copies, cleanup of the
	// removed trees) wind down; a leak stays.
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		d.c.Close()
		res.rssAfter, res.fdsAfter = d.procStats()
		res.gAft = goroutines(t, d)
		if (res.fdsAfter <= res.fdsBefore && res.gAft <= res.goroutinesBefore) || time.Now().After(deadline) {
			break
		}
	}
	return res
}

func cycle(ctx context.Context, c *client.Client, id, h string, k int) error {
	if err := c.Stdin(ctx, id, h, []byte(fmt.Sprintf("x = %d\n", k)), false); err != nil {
		return err
	}
	if v, err := value(ctx, c, id, h, "x"); err != nil || v != fmt.Sprint(k) {
		return fmt.Errorf("x = %q (%v), want %d", v, err, k)
	}
	ck, err := c.Checkpoint(ctx, id, client.CheckpointRequest{Label: fmt.Sprintf("cycle-%d", k)})
	if err != nil {
		return err
	}
	if err := c.Stdin(ctx, id, h, []byte("x = -1\n"), false); err != nil {
		return err
	}
	if v, err := value(ctx, c, id, h, "x"); err != nil || v != "-1" {
		return fmt.Errorf("x = %q (%v), want -1", v, err)
	}
	if _, err := c.Rollback(ctx, id, ck.ID); err != nil {
		return err
	}
	if v, err := value(ctx, c, id, h, "x"); err != nil || v != fmt.Sprint(k) {
		return fmt.Errorf("after rollback x = %q (%v), want %d", v, err, k)
	}
	return nil
}

var valueSeq struct {
	sync.Mutex
	n int
}

// value is replValue for goroutines: it returns errors instead of failing the test.
func value(ctx context.Context, c *client.Client, id, h, expr string) (string, error) {
	valueSeq.Lock()
	valueSeq.n++
	tok := fmt.Sprintf("v%d-%d", os.Getpid(), valueSeq.n)
	valueSeq.Unlock()
	line := fmt.Sprintf("open('/tmp/.v', 'w').write('%s ' + str(%s))\n", tok, expr)
	if err := c.Stdin(ctx, id, h, []byte(line), false); err != nil {
		return "", err
	}
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		b, err := c.ReadFile(ctx, id, "/tmp/.v")
		if v, ok := strings.CutPrefix(string(b), tok+" "); err == nil && ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("the REPL never evaluated %s", expr)
}

func (r loadResult) report(t testing.TB) {
	t.Logf("%d checkpoint+rollback ops in %s: %.1f ops/s; daemon RSS %d -> %d KiB, fds %d -> %d, goroutines %d -> %d",
		r.ops, r.elapsed.Round(time.Millisecond), float64(r.ops)/r.elapsed.Seconds(),
		r.rssBefore, r.rssAfter, r.fdsBefore, r.fdsAfter, r.goroutinesBefore, r.gAft)
}

// TestLoad is the load test at modest size: 4 sandboxes × 5 cycles from 4 clients,
// every state verified; once the sandboxes are removed, the daemon's descriptors and
// goroutines are back where they were before they existed (but for the spare CRIU
// restore workers, kept for the next restores).
func TestLoad(t *testing.T) {
	d := startDaemon(t, nil, "--idle-timeout", "0")
	r := runLoad(t, d, 4, 5, 4)
	r.report(t)
	if r.fdsAfter > r.fdsBefore+8 {
		t.Errorf("cairnd descriptors grew from %d to %d", r.fdsBefore, r.fdsAfter)
	}
	if r.gAft > r.goroutinesBefore+2*4+4 {
		t.Errorf("cairnd goroutines grew from %d to %d", r.goroutinesBefore, r.gAft)
	}
}

// BenchmarkLoad is the full size: 20 sandboxes × 50 cycles from 8 clients.
// Run it with: go test ./api -run '^$' -bench Load -benchtime 1x -timeout 60m
func BenchmarkLoad(b *testing.B) {
	d := startDaemon(b, nil, "--idle-timeout", "0")
	for i := 0; i < b.N; i++ {
		r := runLoad(b, d, 20, 50, 8)
		r.report(b)
		b.ReportMetric(float64(r.ops)/r.elapsed.Seconds(), "ops/s")
		b.ReportMetric(float64(r.rssAfter-r.rssBefore), "rss-growth-KiB")
		b.ReportMetric(float64(r.fdsAfter-r.fdsBefore), "fd-growth")
	}
}

// TestConcurrency: an exec runs during another exec, and the tree is read during a
// checkpoint (while two rollbacks of one sandbox are serialized by the engine).
func TestConcurrency(t *testing.T) {
	d := startDaemon(t, nil)
	ctx := context.Background()
	sb := newSandbox(t, d.c, client.CreateRequest{})
	long := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, err := d.c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"sh", "-c", "echo go; exec sleep 600"}},
			writerFunc(func([]byte) { close(started) }), nil)
		long <- err
	}()
	<-started
	var out strings.Builder
	if res, err := d.c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"echo", "second"}}, &out, io.Discard); err != nil || res.ExitCode != 0 || out.String() != "second\n" {
		t.Fatalf("exec during an exec: %v %+v %q", err, res, out.String())
	}
	select {
	case err := <-long:
		t.Fatalf("the first exec ended early: %v", err)
	default:
	}
	ps, _ := d.c.Processes(ctx, sb.ID)
	for _, p := range ps {
		if p.Running {
			d.c.Signal(ctx, sb.ID, p.Handle, syscall.SIGKILL)
		}
	}
	if err := <-long; err != nil {
		t.Fatal(err)
	}
	// Tree reads during checkpoints.
	h := repl(t, d.c, sb.ID)
	send(t, d.c, sb.ID, h, "data = list(range(3*10**6))")
	replValue(t, d.c, sb.ID, h, "len(data)")
	done := make(chan error, 1)
	go func() { _, err := d.c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{Label: "big"}); done <- err }()
	reads := 0
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d tree reads completed during the checkpoint", reads)
			return
		default:
		}
		if _, err := d.c.Tree(ctx, sb.ID); err != nil {
			t.Fatalf("tree during a checkpoint: %v", err)
		}
		reads++
	}
}
