package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"golang.org/x/sys/unix"
)

// The client stages run inside a sandbox whose FIFOs the host cannot reach (gVisor: the
// sentry implements them, so a host open of /.cairn/ctl finds nothing). cairn starts
// them with `runsc exec`; each talks to the local init through the same files and FIFOs
// the host uses for a container sandbox, and exits. None may outlive its request: a
// process whose stdio are the host's descriptors cannot be checkpointed.

// Exit codes of the client stages, read by the host to classify errors.
const (
	exitNotFound     = 3
	exitPrecondition = 5
)

// clientError carries an exit code to main.
type clientError struct {
	code int
	msg  string
}

func (e *clientError) Error() string { return e.msg }

// boot is PID 1 of a gVisor sandbox: the OCI runtime has built the mounts, hostname and
// network, so only the stdio need pointing inside the sandbox (the runtime's are host
// descriptors) before serving.
func boot() error {
	if err := redirectStdio(); err != nil {
		return err
	}
	return serve()
}

// request performs the initctl.Request read from stdin against the local init and
// prints init's Response as JSON.
func request() error {
	var req initctl.Request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		return fmt.Errorf("bad request on stdin: %w", err)
	}
	resp, err := call(req)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(resp)
}

// call sends one request to init through /.cairn/ctl and waits for its response.
func call(req initctl.Request) (initctl.Response, error) {
	var rb [8]byte
	rand.Read(rb[:])
	rid := hex.EncodeToString(rb[:])
	if err := initctl.WriteJSONAtomic(filepath.Join(base, initctl.ReqDir, rid+".json"), req); err != nil {
		return initctl.Response{}, err
	}
	ctl, err := os.OpenFile(filepath.Join(base, initctl.CtlFIFO), os.O_WRONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return initctl.Response{}, &clientError{exitPrecondition, fmt.Sprintf("init's control pipe: %v", err)}
	}
	_, err = ctl.Write([]byte(rid + "\n"))
	ctl.Close()
	if err != nil {
		return initctl.Response{}, &clientError{exitPrecondition, fmt.Sprintf("write to init: %v", err)}
	}
	respPath := filepath.Join(base, initctl.RespDir, rid+".json")
	deadline := time.Now().Add(30 * time.Second)
	for delay := 50 * time.Microsecond; ; delay = min(delay*2, 2*time.Millisecond) {
		var resp initctl.Response
		if err := initctl.ReadJSON(respPath, &resp); err == nil {
			os.Remove(respPath)
			return resp, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return resp, err
		}
		if time.Now().After(deadline) {
			return initctl.Response{}, errors.New("init did not answer in 30s")
		}
		time.Sleep(delay)
	}
}

// stdin copies this process's stdin into the stdin FIFO of process handle; with "eof"
// it then asks init to close that stdin.
func stdin(args []string) error {
	if len(args) < 1 || !initctl.ValidHandle(args[0]) {
		return fmt.Errorf("usage: cairn-init stdin HANDLE [eof]")
	}
	handle := args[0]
	eof := len(args) > 1 && args[1] == "eof"
	if _, err := os.Stat(initctl.ProcPath(base, handle, "exit")); err == nil {
		return &clientError{exitPrecondition, fmt.Sprintf("process %s has exited", handle)}
	}
	f, err := os.OpenFile(initctl.ProcPath(base, handle, "stdin"), os.O_WRONLY|unix.O_NONBLOCK, 0)
	if errors.Is(err, os.ErrNotExist) {
		return &clientError{exitNotFound, fmt.Sprintf("process %s not found", handle)}
	}
	if err != nil {
		return &clientError{exitPrecondition, fmt.Sprintf("stdin of process %s: %v", handle, err)}
	}
	defer f.Close()
	// Blocking writes from here: a full pipe waits for the reader, as on the host.
	if err := unix.SetNonblock(int(f.Fd()), false); err != nil {
		return err
	}
	if _, err := io.Copy(f, os.Stdin); err != nil {
		return &clientError{exitPrecondition, fmt.Sprintf("write stdin of %s: %v (is the process reading its input?)", handle, err)}
	}
	if !eof {
		return nil
	}
	resp, err := call(initctl.Request{Op: initctl.OpCloseStdin, Handle: handle})
	if err != nil {
		return err
	}
	if !resp.OK {
		return &clientError{exitPrecondition, "close stdin: " + resp.Error}
	}
	return nil
}

// hostname sets the sandbox's hostname: a restored gVisor sandbox comes back with the
// UTS namespace of its image, and a fork needs its own name.
func hostname(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("usage: cairn-init hostname NAME")
	}
	return unix.Sethostname([]byte(args[0]))
}
