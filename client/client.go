// Package client is the Go SDK of cairnd's HTTP API (/v1).
//
// The zero Client works: it talks to $CAIRN_URL (with $CAIRN_TOKEN) if set, else to the
// local daemon's unix socket /run/cairn/cairnd.sock. Every method takes a context.
// Errors from the daemon are *Error values that unwrap to cairn's error classes, so
// errors.Is(err, errdefs.ErrNotFound) and errdefs.Code(err) work as on the engine's.
//
//	var c client.Client
//	sb, err := c.Create(ctx, client.CreateRequest{Labels: map[string]string{"run": "r42"}})
//	res, err := c.Run(ctx, sb.ID, client.ExecRequest{Args: []string{"python3", "-c", "print(1)"}}, os.Stdout, os.Stderr)
//	ck, err := c.Checkpoint(ctx, sb.ID, client.CheckpointRequest{Label: "loaded"})
//	kids, err := c.Fork(ctx, ck.ID, client.ForkRequest{Count: 4})
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// DefaultSocket is the daemon's default unix socket.
const DefaultSocket = "/run/cairn/cairnd.sock"

// Client is a cairnd client. Its zero value is ready to use; set the fields before the
// first call. Safe for concurrent use.
type Client struct {
	// URL is "unix:///path/to.sock", a socket path, or "http://host:port" ("": $CAIRN_URL,
	// else the default socket).
	URL string
	// Token is the bearer token for TCP ("": $CAIRN_TOKEN).
	Token string
	// HTTPClient overrides the HTTP client (its transport must reach URL).
	HTTPClient *http.Client

	once  sync.Once
	base  string // http://host or http://cairnd for a socket
	where string // the daemon's address, for messages
	token string
	hc    *http.Client
	err   error
}

// New returns a client of the daemon at url ("" for the default), with token.
func New(url, token string) *Client { return &Client{URL: url, Token: token} }

func (c *Client) init() error {
	c.once.Do(func() {
		u, tok := c.URL, c.Token
		if u == "" {
			u = os.Getenv("CAIRN_URL")
		}
		if tok == "" {
			tok = os.Getenv("CAIRN_TOKEN")
		}
		if u == "" {
			u = "unix://" + DefaultSocket
		}
		c.token, c.where = tok, u
		var sock string
		switch {
		case strings.HasPrefix(u, "unix://"):
			sock = strings.TrimPrefix(u, "unix://")
		case strings.HasPrefix(u, "unix:"):
			sock = strings.TrimPrefix(u, "unix:")
		case strings.HasPrefix(u, "/"):
			sock = u
		case strings.HasPrefix(u, "http://"), strings.HasPrefix(u, "https://"):
			c.base = strings.TrimRight(u, "/")
		default:
			c.err = errdefs.InvalidArgument("cairnd URL %q: give unix:///path/to.sock or http://host:port", u)
			return
		}
		c.hc = c.HTTPClient
		if sock != "" {
			c.base = "http://cairnd"
			if c.hc == nil {
				tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
					var d net.Dialer
					return d.DialContext(ctx, "unix", sock)
				}, MaxIdleConnsPerHost: 64}
				c.hc = &http.Client{Transport: tr}
			}
		}
		if c.hc == nil {
			c.hc = &http.Client{Transport: &http.Transport{Proxy: http.ProxyFromEnvironment, MaxIdleConnsPerHost: 64}}
		}
	})
	return c.err
}

// Close closes the client's idle connections to the daemon (each holds a descriptor and a
// goroutine there). The client stays usable: a later call connects again.
func (c *Client) Close() error {
	if c.init() == nil {
		c.hc.CloseIdleConnections()
	}
	return nil
}

// Error is an error response of the daemon (an RFC 9457 problem). It unwraps to the
// errdefs class of its Code.
type Error struct {
	Status int
	Code   string
	Detail string
}

func (e *Error) Error() string { return e.Detail }

// Unwrap returns the class: errors.Is(err, errdefs.ErrNotFound) tests it.
func (e *Error) Unwrap() error { return errdefs.FromCode(e.Code) }

// request is one API call.
type request struct {
	method string
	path   string
	query  url.Values
	body   any       // JSON-encoded unless raw is set
	raw    io.Reader // sent as application/octet-stream
}

// send performs a request and returns the response if its status is below 400.
func (c *Client) send(ctx context.Context, rq request) (*http.Response, error) {
	if err := c.init(); err != nil {
		return nil, err
	}
	var body io.Reader
	ctype := ""
	switch {
	case rq.raw != nil:
		body, ctype = rq.raw, "application/octet-stream"
	case rq.body != nil:
		b, err := json.Marshal(rq.body)
		if err != nil {
			return nil, err
		}
		body, ctype = bytes.NewReader(b), "application/json"
	}
	u := c.base + rq.path
	if len(rq.query) > 0 {
		u += "?" + rq.query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, rq.method, u, body)
	if err != nil {
		return nil, err
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, errdefs.Unavailable("cairnd at %s: %v (is cairnd running?)", c.where, err)
	}
	if resp.StatusCode >= 400 {
		defer resp.Body.Close()
		return nil, problem(resp)
	}
	return resp, nil
}

func problem(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var p Problem
	if json.Unmarshal(b, &p) != nil || p.Code == "" {
		return &Error{Status: resp.StatusCode, Code: codeOfStatus(resp.StatusCode),
			Detail: fmt.Sprintf("cairnd: %s: %s", resp.Status, strings.TrimSpace(string(b)))}
	}
	return &Error{Status: p.Status, Code: p.Code, Detail: p.Detail}
}

// codeOfStatus classifies a response that is not a problem (a proxy's, say).
func codeOfStatus(status int) string {
	switch status {
	case http.StatusNotFound:
		return "not_found"
	case http.StatusConflict:
		return "conflict"
	case http.StatusBadRequest, http.StatusMethodNotAllowed:
		return "invalid_argument"
	case http.StatusUnauthorized, http.StatusForbidden:
		return "permission_denied"
	case http.StatusTooManyRequests, http.StatusRequestEntityTooLarge:
		return "resource_exhausted"
	case http.StatusServiceUnavailable, http.StatusBadGateway:
		return "unavailable"
	case http.StatusGatewayTimeout:
		return "deadline_exceeded"
	}
	return "internal"
}

// call performs a request and decodes its JSON response into out (nil: discard).
func (c *Client) call(ctx context.Context, rq request, out any) error {
	resp, err := c.send(ctx, rq)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return errdefs.Unavailable("cairnd at %s: reading the response: %v", c.where, err)
	}
	return nil
}

// Health reports the daemon's health.
func (c *Client) Health(ctx context.Context) (*Health, error) {
	var h Health
	return &h, c.call(ctx, request{method: "GET", path: "/v1/health"}, &h)
}

func pathEsc(s string) string { return url.PathEscape(s) }
