package client

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/url"
	"strings"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// EventFilter selects events; empty fields match everything.
type EventFilter struct {
	Sandboxes []string
	Labels    map[string]string
	Session   string
	Types     []string
}

// EventStream is an open GET /v1/events stream.
type EventStream struct {
	body io.ReadCloser
	r    *bufio.Reader
}

// Events opens the lifecycle event stream. Close it when done.
func (c *Client) Events(ctx context.Context, f EventFilter) (*EventStream, error) {
	q := url.Values{}
	for _, s := range f.Sandboxes {
		q.Add("sandbox", s)
	}
	for k, v := range f.Labels {
		q.Add("label", k+"="+v)
	}
	for _, t := range f.Types {
		q.Add("type", t)
	}
	if f.Session != "" {
		q.Set("session", f.Session)
	}
	resp, err := c.send(ctx, request{method: "GET", path: "/v1/events", query: q})
	if err != nil {
		return nil, err
	}
	return &EventStream{body: resp.Body, r: bufio.NewReader(resp.Body)}, nil
}

// Next blocks until the next event. It fails with an unavailable error when the
// stream ends (the daemon stopped, or this client fell too far behind).
func (s *EventStream) Next() (*Event, error) {
	var typ, data string
	for {
		line, err := s.r.ReadString('\n')
		if err != nil {
			return nil, errdefs.Unavailable("event stream ended: %v", err)
		}
		line = strings.TrimRight(line, "\r\n")
		switch {
		case line == "":
			if typ == "lagged" {
				return nil, errdefs.Unavailable("event stream dropped: this client fell more than 1024 events behind; reconnect")
			}
			if data != "" {
				var ev Event
				if err := json.Unmarshal([]byte(data), &ev); err != nil {
					return nil, err
				}
				return &ev, nil
			}
			typ, data = "", ""
		case strings.HasPrefix(line, ":"):
		case strings.HasPrefix(line, "event:"):
			typ = strings.TrimSpace(strings.TrimPrefix(line, "event:"))
		case strings.HasPrefix(line, "data:"):
			data += strings.TrimPrefix(strings.TrimPrefix(line, "data:"), " ")
		}
	}
}

// Close ends the stream.
func (s *EventStream) Close() error { return s.body.Close() }
