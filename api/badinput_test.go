package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cairn-sandbox/cairn/client"
)

func unixHTTP(sock string) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
}

// TestBadRequests: malformed JSON, wrong types, unknown fields, huge bodies, unknown
// routes, wrong methods and unauthorized TCP calls get clear 4xx problems, and the
// daemon serves on unaffected.
func TestBadRequests(t *testing.T) {
	tokenFile := filepath.Join(t.TempDir(), "tokens")
	os.WriteFile(tokenFile, []byte("# comment\ns3cret\n"), 0o600)
	d := startDaemon(t, nil, "--tcp", "127.0.0.1:0", "--token-file", tokenFile)
	hc := unixHTTP(d.sock)
	sb := newSandbox(t, d.c, client.CreateRequest{})
	huge := `{"labels":{"k":"` + strings.Repeat("x", 2<<20) + `"}}`
	cases := []struct {
		method, path, body string
		status             int
		code, detail       string
	}{
		{"POST", "/v1/sandboxes", `{`, 400, "invalid_argument", "malformed JSON"},
		{"POST", "/v1/sandboxes", `{"ttl_seconds": "soon"}`, 400, "invalid_argument", "ttl_seconds: want an integer"},
		{"POST", "/v1/sandboxes", `{"labels": ["a"]}`, 400, "invalid_argument", "labels"},
		{"POST", "/v1/sandboxes", `{"tempalte": "debian"}`, 400, "invalid_argument", `unknown field "tempalte"`},
		{"POST", "/v1/sandboxes", `{} {}`, 400, "invalid_argument", "after the JSON object"},
		{"POST", "/v1/sandboxes", `[1,2]`, 400, "invalid_argument", "want an object"},
		{"POST", "/v1/sandboxes", `{"expiry_policy": "explode"}`, 400, "invalid_argument", "expiry_policy"},
		{"POST", "/v1/sandboxes", `{"ttl_seconds": 99999999}`, 400, "invalid_argument", "max-ttl"},
		{"POST", "/v1/sandboxes", huge, 413, "resource_exhausted", "larger than"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"args": []}`, 400, "invalid_argument", "args"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"args": "ls"}`, 400, "invalid_argument", "args: want an array"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/rollback", `{}`, 400, "invalid_argument", "checkpoint"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/processes/nope/signal", `{"signal": "BOGUS"}`, 400, "invalid_argument", "unknown signal"},
		{"GET", "/v1/sandboxes/" + sb.ID + "/files/content", ``, 400, "invalid_argument", "path is required"},
		{"GET", "/v1/sandboxes/" + sb.ID + "/files/content?path=../../etc/passwd", ``, 400, "invalid_argument", ".."},
		{"GET", "/v1/sandboxes/nosuchsandbox0", ``, 404, "not_found", "nosuchsandbox0"},
		{"GET", "/v1/sandboxes/Not-An-ID", ``, 400, "invalid_argument", "not a sandbox ID"},
		{"GET", "/v1/sandboxes?state=sleeping", ``, 400, "invalid_argument", "state"},
		{"GET", "/v1/nosuchroute", ``, 404, "not_found", "no route"},
		{"GET", "/v2/sandboxes", ``, 404, "not_found", "no route"},
		{"DELETE", "/v1/health", ``, 405, "invalid_argument", "not allowed"},
		{"PUT", "/v1/sandboxes", `{}`, 405, "invalid_argument", "not allowed"},
	}
	for _, tc := range cases {
		name := tc.method + " " + tc.path
		if len(name) > 80 {
			name = name[:80]
		}
		req, _ := http.NewRequest(tc.method, "http://cairnd"+tc.path, strings.NewReader(tc.body))
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var p client.Problem
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err := json.Unmarshal(b, &p); err != nil || resp.Header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("%s: not a problem (%s): %q", name, resp.Header.Get("Content-Type"), b)
			continue
		}
		if resp.StatusCode != tc.status || p.Status != tc.status || p.Code != tc.code || !strings.Contains(p.Detail, tc.detail) {
			t.Errorf("%s: got %d %+v, want %d %s with %q", name, resp.StatusCode, p, tc.status, tc.code, tc.detail)
		}
	}
	// TCP: a token is required, compared exactly.
	addr := tcpAddr(t, d)
	for _, tok := range []string{"", "wrong", "s3cret2"} {
		req, _ := http.NewRequest("GET", "http://"+addr+"/v1/health", nil)
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 401 || resp.Header.Get("WWW-Authenticate") == "" {
			t.Errorf("TCP with token %q: status %d", tok, resp.StatusCode)
		}
	}
	tc := client.New("http://"+addr, "s3cret")
	if _, err := tc.Get(context.Background(), sb.ID); err != nil {
		t.Fatalf("TCP with the token: %v", err)
	}
	// The daemon is unaffected: the sandbox still runs commands.
	var out bytes.Buffer
	if res, err := d.c.Run(context.Background(), sb.ID, client.ExecRequest{Args: []string{"echo", "alive"}}, &out, nil); err != nil || res.ExitCode != 0 || out.String() != "alive\n" {
		t.Fatalf("after bad requests: %v %+v %q", err, res, out.String())
	}
}

// tcpAddr finds the TCP address cairnd listens on (it was given port 0).
func tcpAddr(t testing.TB, d *daemon) string {
	t.Helper()
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/net/tcp", d.cmd.Process.Pid))
	ino := map[string]bool{}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.cmd.Process.Pid))
	for _, fd := range fds {
		l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", d.cmd.Process.Pid, fd.Name()))
		if s, ok := strings.CutPrefix(l, "socket:["); ok {
			ino[strings.TrimSuffix(s, "]")] = true
		}
	}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 9 && f[3] == "0A" && ino[f[9]] { // LISTEN
			var port int
			fmt.Sscanf(strings.Split(f[1], ":")[1], "%X", &port)
			return fmt.Sprintf("127.0.0.1:%d", port)
		}
	}
	t.Fatal("cairnd has no TCP listener")
	return ""
}
