package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
)

// Exit codes of cairn-init's client stages (cmd/cairn-init/client.go).
const (
	clientNotFound     = 3
	clientPrecondition = 5
)

// initPath is cairn-init inside the sandbox.
var initPath = "/" + filepath.Join(initctl.Dir, initctl.InitBin)

// client runs one cairn-init client stage in the sandbox with `runsc exec` (one runsc
// start-up) and maps its exit code to an error class.
func (b *Backend) client(ctx context.Context, sb *isolation.Sandbox, in []byte, args ...string) ([]byte, error) {
	if !b.Running(sb) {
		return nil, errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	out, err := b.run(ctx, in, append([]string{"exec", cid(sb), initPath}, args...)...)
	if err == nil {
		return out, nil
	}
	msg := err.Error()
	if re, ok := err.(*runscError); ok && re.stderr != "" {
		msg = re.stderr
	}
	switch exitCode(err) {
	case clientNotFound:
		return nil, errdefs.NotFound("sandbox %s: %s", sb.ID, msg)
	case clientPrecondition:
		return nil, errdefs.FailedPrecondition("sandbox %s: %s", sb.ID, msg)
	}
	return nil, errdefs.Unavailable("sandbox %s: %s", sb.ID, msg)
}

// call sends one request to the sandbox's init and returns its response.
func (b *Backend) call(ctx context.Context, sb *isolation.Sandbox, req initctl.Request) (initctl.Response, error) {
	in, _ := json.Marshal(req)
	out, err := b.client(ctx, sb, in, "request")
	if err != nil {
		return initctl.Response{}, err
	}
	var resp initctl.Response
	if err := json.Unmarshal(out, &resp); err != nil {
		return resp, fmt.Errorf("sandbox %s: bad answer from init %q: %w", sb.ID, strings.TrimSpace(string(out)), err)
	}
	return resp, nil
}

// Exec implements isolation.Backend.
func (b *Backend) Exec(ctx context.Context, sb *isolation.Sandbox, handle string, spec isolation.ProcSpec) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpSpawn, Handle: handle, Spec: &spec})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "exec "+spec.Args[0])
}

// Signal implements isolation.Backend.
func (b *Backend) Signal(ctx context.Context, sb *isolation.Sandbox, handle string, sig syscall.Signal) error {
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpSignal, Handle: handle, Signal: int(sig)})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "signal "+signalName(sig)+" to "+handle)
}

// CostlyCalls implements isolation.CostlyCalls: each call to init is a runsc exec.
func (b *Backend) CostlyCalls() bool { return true }

var _ isolation.CostlyCalls = (*Backend)(nil)

// RemoveRecord implements isolation.Backend: init removes it (initctl.OpRemove).
func (b *Backend) RemoveRecord(ctx context.Context, sb *isolation.Sandbox, handle string) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpRemove, Handle: handle})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "remove the record of "+handle)
}

// WriteStdin implements isolation.Backend: one `runsc exec` copies data into the
// process's stdin FIFO inside the sandbox and, if eof, has init close it.
func (b *Backend) WriteStdin(ctx context.Context, sb *isolation.Sandbox, handle string, data []byte, eof bool) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	// The exit file is a regular file on the root: checked here, a write to an exited
	// process costs no runsc start-up.
	if _, err := os.Stat(initctl.ProcPath(filepath.Join(sb.Root, initctl.Dir), handle, "exit")); err == nil {
		return errdefs.FailedPrecondition("process %s has exited", handle)
	}
	args := []string{"stdin", handle}
	if eof {
		args = append(args, "eof")
	}
	if data == nil {
		data = []byte{}
	}
	_, err := b.client(ctx, sb, data, args...)
	return err
}
