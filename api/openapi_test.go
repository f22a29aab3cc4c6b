package api_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
	"github.com/google/go-cmp/cmp"

	"github.com/cairn-sandbox/cairn/api"
	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func loadDoc(t testing.TB) *openapi3.T {
	t.Helper()
	doc, err := openapi3.NewLoader().LoadFromData(api.OpenAPIYAML())
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("openapi.yaml is not a valid OpenAPI document: %v", err)
	}
	if !doc.IsOpenAPI31OrLater() {
		t.Fatalf("openapi.yaml is OpenAPI %s, want 3.1", doc.OpenAPI)
	}
	return doc
}

// TestRoutesDocumented: every route the server serves is documented, and every
// documented route is served.
func TestRoutesDocumented(t *testing.T) {
	doc := loadDoc(t)
	var documented []string
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			documented = append(documented, method+" "+path)
		}
	}
	sort.Strings(documented)
	if d := cmp.Diff(documented, api.Routes()); d != "" {
		t.Fatalf("documented routes (-) differ from served routes (+):\n%s", d)
	}
	if _, err := api.OpenAPIJSON(); err != nil {
		t.Fatalf("served document: %v", err)
	}
}

// validator is an http.RoundTripper that checks every request and response against the
// document: bodies, parameters, statuses. NDJSON streams are checked line by line.
type validator struct {
	t      testing.TB
	doc    *openapi3.T
	router routers.Router
	inner  http.RoundTripper

	mu   sync.Mutex
	seen map[string]bool // "METHOD /path" of validated operations
}

func newValidator(t testing.TB, doc *openapi3.T, sock string) *validator {
	doc.Servers = openapi3.Servers{{URL: "http://cairnd"}}
	r, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	inner := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
	return &validator{t: t, doc: doc, router: r, inner: inner, seen: map[string]bool{}}
}

var vopts = &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc, IncludeResponseStatus: true}

func (v *validator) RoundTrip(req *http.Request) (*http.Response, error) {
	var body []byte
	if req.Body != nil {
		body, _ = io.ReadAll(req.Body)
		req.Body = io.NopCloser(bytes.NewReader(body))
	}
	route, params, err := v.router.FindRoute(req)
	if err != nil {
		v.t.Errorf("%s %s: not in the document: %v", req.Method, req.URL.Path, err)
		return v.inner.RoundTrip(req)
	}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route, Options: vopts}
	if err := openapi3filter.ValidateRequest(req.Context(), in); err != nil {
		v.t.Errorf("request %s %s does not match the document: %v", req.Method, req.URL, err)
	}
	if req.Body != nil {
		req.Body = io.NopCloser(bytes.NewReader(body))
	}
	resp, err := v.inner.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	rbody, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(rbody))
	opts := *vopts
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/x-ndjson") {
		opts.ExcludeResponseBody = true
		v.checkLines(req, rbody)
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode,
		Header: resp.Header, Body: io.NopCloser(bytes.NewReader(rbody)), Options: &opts}
	if err := openapi3filter.ValidateResponse(req.Context(), out); err != nil {
		v.t.Errorf("response of %s %s (%d) does not match the document: %v\nbody: %.500s", req.Method, req.URL, resp.StatusCode, err, rbody)
	}
	v.mu.Lock()
	v.seen[route.Method+" "+route.Path] = true
	v.mu.Unlock()
	return resp, nil
}

// checkLines validates each NDJSON line against the Chunk schema.
func (v *validator) checkLines(req *http.Request, b []byte) {
	schema := v.doc.Components.Schemas["Chunk"].Value
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 64<<20)
	for sc.Scan() {
		var x any
		if err := json.Unmarshal(sc.Bytes(), &x); err != nil {
			v.t.Errorf("%s %s: NDJSON line is not JSON: %q", req.Method, req.URL.Path, sc.Text())
			continue
		}
		if err := schema.VisitJSON(x, openapi3.EnableJSONSchema2020()); err != nil {
			v.t.Errorf("%s %s: NDJSON line %s does not match Chunk: %v", req.Method, req.URL.Path, sc.Text(), err)
		}
	}
}

// TestOpenAPIAgreement runs a representative session through a client whose every
// request and response is validated against the document, and checks that it covered
// every documented operation (but the streams of events and the metrics).
func TestOpenAPIAgreement(t *testing.T) {
	d := startDaemon(t, nil)
	doc := loadDoc(t)
	v := newValidator(t, doc, d.sock)
	c := &client.Client{URL: "unix://" + d.sock, HTTPClient: &http.Client{Transport: v}}
	ctx := context.Background()
	must := mustFunc(t)
	_, err := c.Health(ctx)
	must(err)
	resp, err := c.HTTPClient.Get("http://cairnd/v1/openapi.json")
	must(err)
	resp.Body.Close()
	sb := newSandbox(t, c, client.CreateRequest{Labels: map[string]string{"test": "openapi"},
		Lifetime: client.Lifetime{TTLSeconds: 600, ExpiryPolicy: "pause", RunID: "r1"}})
	_, err = c.Get(ctx, sb.ID)
	must(err)
	_, err = c.List(ctx, client.ListOptions{Labels: map[string]string{"test": "openapi"}, Run: "r1", State: "running"})
	must(err)
	ttl := int64(900)
	_, err = c.Update(ctx, sb.ID, client.UpdateRequest{TTLSeconds: &ttl})
	must(err)
	res, err := c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"sh", "-c", "echo out; echo err >&2; cat; exit 3"}, Stdin: "in\n"}, io.Discard, io.Discard)
	must(err)
	if res.ExitCode != 3 {
		t.Fatalf("exit code %d, want 3", res.ExitCode)
	}
	// The stream removes the record it carried, unless asked to keep it.
	if _, err := c.Process(ctx, sb.ID, res.Handle); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("record of a finished exec: %v, want not found", err)
	}
	kept, err := c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"true"}, Keep: true}, nil, nil)
	must(err)
	if p, err := c.Process(ctx, sb.ID, kept.Handle); err != nil || p.Exit == nil {
		t.Fatalf("record of an exec with keep: %+v %v", p, err)
	}
	h := repl(t, c, sb.ID)
	send(t, c, sb.ID, h, "x = 41")
	_, err = c.Processes(ctx, sb.ID)
	must(err)
	_, err = c.Process(ctx, sb.ID, h)
	must(err)
	_, _, err = c.Output(ctx, sb.ID, h, "stdout", 0)
	must(err)
	fi, err := c.WriteFile(ctx, sb.ID, "/workspace/a.txt", []byte("hello"), 0o600)
	must(err)
	if fi.Size != 5 {
		t.Fatalf("write: %+v", fi)
	}
	_, err = c.ReadFile(ctx, sb.ID, "/workspace/a.txt")
	must(err)
	_, err = c.Stat(ctx, sb.ID, "/workspace/a.txt")
	must(err)
	_, err = c.ListDir(ctx, sb.ID, "/workspace")
	must(err)
	c1, err := c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{Label: "one"})
	must(err)
	must(c.RemovePath(ctx, sb.ID, "/workspace/a.txt"))
	c2, err := c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{})
	must(err)
	_, err = c.Diff(ctx, c1.ID, c2.ID)
	must(err)
	_, err = c.GetCheckpoint(ctx, c1.ID)
	must(err)
	_, err = c.Tree(ctx, sb.ID)
	must(err)
	_, err = c.Rollback(ctx, sb.ID, c1.ID)
	must(err)
	if got := replValue(t, c, sb.ID, h, "x"); got != "41" {
		t.Fatalf("x after rollback = %s, want 41", got)
	}
	// gvisor has no standbys: prewarm answers a problem (checked against the spec too).
	if _, err = c.Prewarm(ctx, c1.ID, 1); sb.Isolation != "gvisor" || !errorsIs(err, errdefs.ErrFailedPrecondition) {
		must(err)
	}
	_, err = c.Standbys(ctx, c1.ID)
	must(err)
	kids, err := c.Fork(ctx, c1.ID, client.ForkRequest{Count: 1, Labels: map[string]string{"kid": "1"}})
	must(err)
	if len(kids) != 1 || kids[0].Labels["kid"] != "1" || kids[0].Labels["test"] != "openapi" || kids[0].RunID != "r1" {
		t.Fatalf("fork: %+v", kids)
	}
	_, err = c.Stop(ctx, kids[0].ID)
	must(err)
	_, err = c.Resume(ctx, kids[0].ID)
	must(err)
	must(c.Remove(ctx, kids[0].ID))
	must(c.Signal(ctx, sb.ID, h, syscall.SIGKILL))
	if _, err := c.Wait(ctx, sb.ID, h); err != nil {
		t.Fatal(err)
	}
	_, err = c.Follow(ctx, sb.ID, h, io.Discard, io.Discard)
	must(err)
	must(c.RemoveProcess(ctx, sb.ID, h))
	if _, err := c.Process(ctx, sb.ID, h); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("process after its removal: %v", err)
	}
	removed, err := c.DeleteCheckpoint(ctx, c2.ID, false)
	must(err)
	if len(removed) != 1 {
		t.Fatalf("delete checkpoint: %v", removed)
	}
	_, err = c.Templates(ctx)
	must(err)
	_, err = c.GC(ctx)
	must(err)
	// Errors are documented problems too.
	if _, err := c.Get(ctx, "nosuchsandbox0"); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("get unknown: %v", err)
	}
	if _, err := c.BuildTemplate(ctx, client.TemplateRequest{Name: "debian", Dir: "/nonexistent"}); err == nil {
		t.Fatal("building an existing template succeeded")
	}
	if err := c.RemoveTemplate(ctx, "nosuchtemplate"); !errorsIs(err, errdefs.ErrNotFound) {
		t.Fatalf("remove unknown template: %v", err)
	}
	checkCoverage(t, doc, v)
}

// checkCoverage fails for each documented operation the validator did not see (but the
// event stream and the metrics, which are tested elsewhere).
func checkCoverage(t *testing.T, doc *openapi3.T, v *validator) {
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			op := method + " " + path
			if !v.seen[op] && op != "GET /v1/events" && op != "GET /metrics" {
				t.Errorf("the representative run did not exercise %s", op)
			}
		}
	}
}

func mustFunc(t *testing.T) func(error) {
	return func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
}
