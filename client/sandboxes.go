package client

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"net/url"
	"strconv"

	"github.com/cairn-sandbox/cairn/engine/model"
)

func sbPath(id string, rest ...string) string {
	p := "/v1/sandboxes/" + pathEsc(id)
	for _, r := range rest {
		p += "/" + r
	}
	return p
}

// Create makes and starts a sandbox.
func (c *Client) Create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "POST", path: "/v1/sandboxes", body: req}, &sb)
}

// Get returns a sandbox.
func (c *Client) Get(ctx context.Context, id string) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "GET", path: sbPath(id)}, &sb)
}

// List returns the sandboxes matching opts, oldest first.
func (c *Client) List(ctx context.Context, opts ListOptions) ([]*Sandbox, error) {
	q := url.Values{}
	for k, v := range opts.Labels {
		q.Add("label", k+"="+v)
	}
	for k, v := range map[string]string{"session": opts.Session, "run": opts.Run, "state": opts.State} {
		if v != "" {
			q.Set(k, v)
		}
	}
	var l SandboxList
	return l.Sandboxes, c.call(ctx, request{method: "GET", path: "/v1/sandboxes", query: q}, &l)
}

// Update changes a sandbox's TTL, expiry policy or idle timeout.
func (c *Client) Update(ctx context.Context, id string, req UpdateRequest) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "PATCH", path: sbPath(id), body: req}, &sb)
}

// Remove stops and deletes a sandbox.
func (c *Client) Remove(ctx context.Context, id string) error {
	return c.call(ctx, request{method: "DELETE", path: sbPath(id)}, nil)
}

// Stop stops a sandbox's processes, keeping its files and checkpoints.
func (c *Client) Stop(ctx context.Context, id string) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "POST", path: sbPath(id, "stop")}, &sb)
}

// Resume restarts a stopped or paused sandbox from its head checkpoint.
func (c *Client) Resume(ctx context.Context, id string) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "POST", path: sbPath(id, "resume")}, &sb)
}

// Checkpoint takes a joint checkpoint of a running sandbox.
func (c *Client) Checkpoint(ctx context.Context, id string, req CheckpointRequest) (*Checkpoint, error) {
	var ck Checkpoint
	return &ck, c.call(ctx, request{method: "POST", path: sbPath(id, "checkpoints"), body: req}, &ck)
}

// Rollback returns a sandbox, files and processes, to a checkpoint of its lineage.
func (c *Client) Rollback(ctx context.Context, id, checkpoint string) (*Sandbox, error) {
	var sb Sandbox
	return &sb, c.call(ctx, request{method: "POST", path: sbPath(id, "rollback"), body: RollbackRequest{Checkpoint: checkpoint}}, &sb)
}

// Fork makes new sandboxes from a checkpoint (req.Count, default 1).
func (c *Client) Fork(ctx context.Context, checkpoint string, req ForkRequest) ([]*Sandbox, error) {
	var l SandboxList
	return l.Sandboxes, c.call(ctx, request{method: "POST", path: "/v1/checkpoints/" + pathEsc(checkpoint) + "/fork", body: req}, &l)
}

// Prewarm prepares count standbys of a checkpoint (1 to 256) and returns once they are
// ready, with how many standbys of it are ready then. A standby is the checkpoint
// restored ahead of time and kept frozen: the next count rollbacks or forks to it are
// thaws (milliseconds) instead of restores (~150 ms). Each costs a restore now and
// holds its memory until taken or evicted (the daemon's standby budget, oldest first).
func (c *Client) Prewarm(ctx context.Context, checkpoint string, count int) (int, error) {
	var st Standbys
	err := c.call(ctx, request{method: "POST", path: "/v1/checkpoints/" + pathEsc(checkpoint) + "/prewarm", body: PrewarmRequest{Count: &count}}, &st)
	return st.Standbys, err
}

// Standbys returns how many standbys of a checkpoint are ready.
func (c *Client) Standbys(ctx context.Context, checkpoint string) (int, error) {
	var st Standbys
	err := c.call(ctx, request{method: "GET", path: "/v1/checkpoints/" + pathEsc(checkpoint) + "/standbys"}, &st)
	return st.Standbys, err
}

// Tree returns the checkpoints of a sandbox's lineage, oldest first.
func (c *Client) Tree(ctx context.Context, id string) (*Tree, error) {
	var t Tree
	return &t, c.call(ctx, request{method: "GET", path: sbPath(id, "tree")}, &t)
}

// GetCheckpoint returns one checkpoint.
func (c *Client) GetCheckpoint(ctx context.Context, id string) (*Checkpoint, error) {
	var ck Checkpoint
	return &ck, c.call(ctx, request{method: "GET", path: "/v1/checkpoints/" + pathEsc(id)}, &ck)
}

// DeleteCheckpoint deletes a checkpoint (with cascade, its subtree) and returns the IDs
// deleted.
func (c *Client) DeleteCheckpoint(ctx context.Context, id string, cascade bool) ([]string, error) {
	var r Removed
	q := url.Values{"cascade": {strconv.FormatBool(cascade)}}
	return r.Removed, c.call(ctx, request{method: "DELETE", path: "/v1/checkpoints/" + pathEsc(id), query: q}, &r)
}

// Diff lists the paths that differ between two checkpoints' filesystems.
func (c *Client) Diff(ctx context.Context, from, to string) ([]model.Change, error) {
	var l ChangeList
	return l.Changes, c.call(ctx, request{method: "GET", path: "/v1/checkpoints/" + pathEsc(from) + "/diff/" + pathEsc(to)}, &l)
}

// GC deletes checkpoints and files nothing references.
func (c *Client) GC(ctx context.Context) (*GCReport, error) {
	var r GCReport
	return &r, c.call(ctx, request{method: "POST", path: "/v1/gc"}, &r)
}

func pathQ(p string) url.Values { return url.Values{"path": {p}} }

// ReadFile reads a file of a sandbox.
func (c *Client) ReadFile(ctx context.Context, id, p string) ([]byte, error) {
	resp, err := c.send(ctx, request{method: "GET", path: sbPath(id, "files", "content"), query: pathQ(p)})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(resp.Body)
}

// WriteFile writes a file of a sandbox atomically (mode 0: 0644).
func (c *Client) WriteFile(ctx context.Context, id, p string, data []byte, mode fs.FileMode) (*FileInfo, error) {
	q := pathQ(p)
	if mode != 0 {
		q.Set("mode", strconv.FormatUint(uint64(mode.Perm()), 8))
	}
	var fi FileInfo
	return &fi, c.call(ctx, request{method: "PUT", path: sbPath(id, "files", "content"), query: q, raw: bytes.NewReader(data)}, &fi)
}

// Stat describes a path of a sandbox.
func (c *Client) Stat(ctx context.Context, id, p string) (*FileInfo, error) {
	var fi FileInfo
	return &fi, c.call(ctx, request{method: "GET", path: sbPath(id, "files", "stat"), query: pathQ(p)}, &fi)
}

// ListDir lists a directory of a sandbox.
func (c *Client) ListDir(ctx context.Context, id, p string) ([]*FileInfo, error) {
	var l FileList
	return l.Entries, c.call(ctx, request{method: "GET", path: sbPath(id, "files", "list"), query: pathQ(p)}, &l)
}

// RemovePath removes a file or (recursively) a directory of a sandbox.
func (c *Client) RemovePath(ctx context.Context, id, p string) error {
	return c.call(ctx, request{method: "DELETE", path: sbPath(id, "files"), query: pathQ(p)}, nil)
}

// Templates lists the templates.
func (c *Client) Templates(ctx context.Context) ([]*Template, error) {
	var l TemplateList
	return l.Templates, c.call(ctx, request{method: "GET", path: "/v1/templates"}, &l)
}

// BuildTemplate builds or imports a template (synchronous).
func (c *Client) BuildTemplate(ctx context.Context, req TemplateRequest) (*Template, error) {
	var t Template
	return &t, c.call(ctx, request{method: "POST", path: "/v1/templates", body: req}, &t)
}

// RemoveTemplate deletes a template.
func (c *Client) RemoveTemplate(ctx context.Context, name string) error {
	return c.call(ctx, request{method: "DELETE", path: "/v1/templates/" + pathEsc(name)}, nil)
}
