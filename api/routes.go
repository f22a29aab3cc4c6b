package api

import (
	"context"
	_ "embed"
	"encoding/json"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

type route struct {
	pattern string
	h       func(*Server, http.ResponseWriter, *http.Request) error
}

// routes is the whole API; api/openapi.yaml documents exactly these (a test checks).
var routes = []route{
	{"GET /v1/health", (*Server).health},
	{"GET /v1/openapi.json", (*Server).openapi},
	{"GET /metrics", (*Server).promMetrics},
	{"GET /v1/events", (*Server).events},
	{"GET /v1/sandboxes", (*Server).listSandboxes},
	{"POST /v1/sandboxes", (*Server).createSandbox},
	{"GET /v1/sandboxes/{id}", (*Server).getSandbox},
	{"PATCH /v1/sandboxes/{id}", (*Server).updateSandbox},
	{"DELETE /v1/sandboxes/{id}", (*Server).removeSandbox},
	{"POST /v1/sandboxes/{id}/stop", (*Server).stopSandbox},
	{"POST /v1/sandboxes/{id}/resume", (*Server).resumeSandbox},
	{"POST /v1/sandboxes/{id}/exec", (*Server).execStream},
	{"GET /v1/sandboxes/{id}/processes", (*Server).listProcesses},
	{"POST /v1/sandboxes/{id}/processes", (*Server).spawnProcess},
	{"GET /v1/sandboxes/{id}/processes/{handle}", (*Server).getProcess},
	{"DELETE /v1/sandboxes/{id}/processes/{handle}", (*Server).removeProcess},
	{"GET /v1/sandboxes/{id}/processes/{handle}/output", (*Server).processOutput},
	{"POST /v1/sandboxes/{id}/processes/{handle}/stdin", (*Server).writeStdin},
	{"POST /v1/sandboxes/{id}/processes/{handle}/signal", (*Server).signalProcess},
	{"POST /v1/sandboxes/{id}/processes/{handle}/wait", (*Server).waitProcess},
	{"POST /v1/sandboxes/{id}/checkpoints", (*Server).checkpoint},
	{"POST /v1/sandboxes/{id}/rollback", (*Server).rollback},
	{"GET /v1/sandboxes/{id}/tree", (*Server).tree},
	{"DELETE /v1/sandboxes/{id}/files", (*Server).removePath},
	{"GET /v1/sandboxes/{id}/files/content", (*Server).readFile},
	{"PUT /v1/sandboxes/{id}/files/content", (*Server).writeFile},
	{"GET /v1/sandboxes/{id}/files/stat", (*Server).statPath},
	{"GET /v1/sandboxes/{id}/files/list", (*Server).listDir},
	{"GET /v1/checkpoints/{id}", (*Server).getCheckpoint},
	{"DELETE /v1/checkpoints/{id}", (*Server).deleteCheckpoint},
	{"POST /v1/checkpoints/{id}/fork", (*Server).fork},
	{"POST /v1/checkpoints/{id}/prewarm", (*Server).prewarm},
	{"GET /v1/checkpoints/{id}/standbys", (*Server).standbys},
	{"GET /v1/checkpoints/{id}/diff/{to}", (*Server).diff},
	{"GET /v1/templates", (*Server).listTemplates},
	{"POST /v1/templates", (*Server).buildTemplate},
	{"DELETE /v1/templates/{name}", (*Server).removeTemplate},
	{"POST /v1/gc", (*Server).gc},
}

// Routes lists the API's routes as net/http patterns ("GET /v1/sandboxes/{id}").
func Routes() []string {
	out := make([]string, len(routes))
	for i, r := range routes {
		out[i] = r.pattern
	}
	sort.Strings(out)
	return out
}

//go:embed openapi.yaml
var openapiYAML []byte

// OpenAPIYAML is the API's OpenAPI 3.1 document as checked in.
func OpenAPIYAML() []byte { return openapiYAML }

var (
	specOnce sync.Once
	specJSON []byte
	specErr  error
)

// OpenAPIJSON is the document as JSON (what /v1/openapi.json serves).
func OpenAPIJSON() ([]byte, error) {
	specOnce.Do(func() {
		var doc *openapi3.T
		if doc, specErr = openapi3.NewLoader().LoadFromData(openapiYAML); specErr == nil {
			specJSON, specErr = json.Marshal(doc)
		}
	})
	return specJSON, specErr
}

func (s *Server) openapi(w http.ResponseWriter, r *http.Request) error {
	b, err := OpenAPIJSON()
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	_, err = w.Write(b)
	return err
}

func (s *Server) promMetrics(w http.ResponseWriter, r *http.Request) error {
	s.metrics.handler().ServeHTTP(w, r)
	return nil
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) error {
	return writeJSON(w, http.StatusOK, client.Health{Status: "ok", Version: s.cfg.Version,
		UptimeSeconds: time.Since(s.started).Seconds(), DataDir: s.eng.DataDir(), Sandboxes: s.sessions.count()})
}

// op runs one engine operation, recording its latency and result.
func (s *Server) op(name string, f func() error) error {
	start := time.Now()
	err := f()
	s.metrics.observe(name, start, err)
	return err
}

// labelQuery parses repeated label=k=v query values.
func labelQuery(vals []string) (map[string]string, error) {
	out := map[string]string{}
	for _, p := range vals {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("label filter %q: write it as key=value", p)
		}
		out[k] = v
	}
	return out, nil
}

func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

// boolQuery reads an optional boolean query parameter.
func boolQuery(q url.Values, name string) (bool, error) {
	switch v := q.Get(name); v {
	case "", "false", "0":
		return false, nil
	case "true", "1":
		return true, nil
	default:
		return false, errdefs.InvalidArgument("query parameter %s=%q: give true or false", name, v)
	}
}

// sandboxCall wraps a handler body that works on sandbox {id}: the call counts as
// activity, and with needRunning a sandbox paused by the daemon is resumed first.
func (s *Server) sandboxCall(r *http.Request, needRunning bool, f func(ctx context.Context, id string) error) error {
	id := r.PathValue("id")
	release, err := s.sessions.acquire(r.Context(), id, needRunning)
	if err != nil {
		return err
	}
	defer release()
	return f(r.Context(), id)
}
