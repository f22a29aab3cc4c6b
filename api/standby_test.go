package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// TestPrewarm: POST /v1/checkpoints/{id}/prewarm returns once the standbys are ready
// and counts them; GET .../standbys counts them; a rollback to the checkpoint (which
// takes one) still restores the REPL's state; /metrics shows the cache; unknown
// checkpoints are 404 and bad counts 400.
func TestPrewarm(t *testing.T) {
	d := startDaemon(t, nil)
	ctx := context.Background()
	c := d.c
	// Standbys exist for the container backend (gvisor has none).
	sb := newSandbox(t, c, client.CreateRequest{Isolation: "container", Labels: map[string]string{"test": "prewarm"}})
	h := repl(t, c, sb.ID)
	send(t, c, sb.ID, h, "x = 41")
	replValue(t, c, sb.ID, h, "x")
	ck, err := c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{Label: "warm"})
	if err != nil {
		t.Fatal(err)
	}
	// The checkpoint may get a standby of its own in the background meanwhile: counts
	// are at least what was prepared.
	n, err := c.Prewarm(ctx, ck.ID, 2)
	if err != nil || n < 2 {
		t.Fatalf("prewarm 2: %d standbys, %v", n, err)
	}
	if got, err := c.Standbys(ctx, ck.ID); err != nil || got < 2 {
		t.Fatalf("standbys after prewarm 2: %d, %v", got, err)
	}
	// An absent count is 1, which 2 ready standbys already cover: prewarm tops up.
	st := postJSON(t, d, "/v1/checkpoints/"+ck.ID+"/prewarm", ``, http.StatusOK)
	if st.Checkpoint != ck.ID || st.Standbys < 2 {
		t.Fatalf("prewarm without a body: %+v", st)
	}
	if n, err := c.Prewarm(ctx, ck.ID, 3); err != nil || n < 3 {
		t.Fatalf("prewarm 3: %d standbys, %v", n, err)
	}
	send(t, c, sb.ID, h, "x += 1")
	if v := replValue(t, c, sb.ID, h, "x"); v != "42" {
		t.Fatalf("x = %s, want 42", v)
	}
	if _, err := c.Rollback(ctx, sb.ID, ck.ID); err != nil {
		t.Fatal(err)
	}
	if v := replValue(t, c, sb.ID, h, "x"); v != "41" {
		t.Fatalf("x after a rollback to a prewarmed checkpoint = %s, want 41", v)
	}
	if held, mem := standbyMetrics(t, d); held < 1 || mem <= 0 {
		t.Fatalf("metrics: cairn_standbys %v, cairn_standby_memory_bytes %v", held, mem)
	}

	// Errors: the same vocabulary as the rest of the API.
	if _, err := c.Prewarm(ctx, "nosuchckpt0", 1); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("prewarm of an unknown checkpoint: %v", err)
	}
	if _, err := c.Standbys(ctx, "nosuchckpt0"); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("standbys of an unknown checkpoint: %v", err)
	}
	for _, bad := range []int{0, -1, 257} {
		if _, err := c.Prewarm(ctx, ck.ID, bad); !errorsIs(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "1 to 256") {
			t.Fatalf("prewarm count %d: %v", bad, err)
		}
	}
	for _, body := range []string{`{"count": "two"}`, `{"n": 2}`} {
		if err := postProblem(t, d, "/v1/checkpoints/"+ck.ID+"/prewarm", body); err.Status != 400 || err.Code != "invalid_argument" {
			t.Fatalf("prewarm %s: %+v", body, err)
		}
	}
}

// TestPrewarmGVisor: a gvisor checkpoint has no standbys; prewarm says so.
func TestPrewarmGVisor(t *testing.T) {
	d := startDaemon(t, nil)
	ctx := context.Background()
	sb := newSandbox(t, d.c, client.CreateRequest{Isolation: "gvisor"})
	if sb.Isolation != "gvisor" {
		t.Skipf("gvisor is unavailable here (created %s)", sb.Isolation)
	}
	ck, err := d.c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := d.c.Prewarm(ctx, ck.ID, 1); !errorsIs(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("prewarm of a gvisor checkpoint: %d standbys, %v; want failed_precondition", n, err)
	}
	if n, err := d.c.Standbys(ctx, ck.ID); err != nil || n != 0 {
		t.Fatalf("standbys of a gvisor checkpoint: %d, %v; want 0", n, err)
	}
}

func postJSON(t *testing.T, d *daemon, path, body string, status int) client.Standbys {
	t.Helper()
	resp, err := unixHTTP(d.sock).Post("http://cairnd"+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st client.Standbys
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil || resp.StatusCode != status {
		t.Fatalf("POST %s %s: status %d, %v", path, body, resp.StatusCode, err)
	}
	return st
}

func postProblem(t *testing.T, d *daemon, path, body string) client.Problem {
	t.Helper()
	resp, err := unixHTTP(d.sock).Post("http://cairnd"+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var p client.Problem
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil || resp.Header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("POST %s %s: not a problem (%v)", path, body, err)
	}
	return p
}

// standbyMetrics reads cairn_standbys and cairn_standby_memory_bytes from /metrics.
func standbyMetrics(t *testing.T, d *daemon) (held, mem float64) {
	t.Helper()
	resp, err := unixHTTP(d.sock).Get("http://cairnd/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	seen := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, v, _ := strings.Cut(sc.Text(), " ")
		f, err := strconv.ParseFloat(v, 64)
		switch {
		case name == "cairn_standbys" && err == nil:
			held, seen = f, seen+1
		case name == "cairn_standby_memory_bytes" && err == nil:
			mem, seen = f, seen+1
		}
	}
	if seen != 2 {
		t.Fatal("/metrics lacks cairn_standbys or cairn_standby_memory_bytes")
	}
	return held, mem
}
