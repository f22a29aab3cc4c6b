package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

type execFlags struct {
	detach, tty, interactive, keep bool
	env                            []string
	cwd                            string
}

func newExecCmd(a *app) *cobra.Command {
	var fl execFlags
	cmd := &cobra.Command{
		Use:   "exec [flags] SANDBOX -- COMMAND [ARG...]",
		Short: "Run a command in a sandbox",
		Long: `Exec runs a command in a running sandbox.

In the foreground (the default) the command's standard output and error are streamed
to cairn's, and cairn exits with the command's exit code (128+N if killed by signal
N). The command's standard input is empty unless -i is given, in which case cairn's
standard input is copied to it and closed at end of input. Interrupting cairn sends
SIGTERM to the command. Once it has exited and its output is shown, its record
(output, exit status) is removed from the sandbox; --keep keeps it for ` + "`cairn ps`" + `
and ` + "`cairn logs`" + ` (records are part of the sandbox's root, so of every checkpoint).

With -d the command is started in the background and its process handle is printed as
the last line of standard output. Its standard input stays open: write to it with
` + "`cairn stdin`" + `, read its output with ` + "`cairn logs`" + `, stop it with ` + "`cairn kill`" + `.
The handle stays valid across rollbacks and in forks of later checkpoints.

-t runs the command on a pseudo-terminal (combine with -i for an interactive shell).
Everything after "--" (or after SANDBOX) is the command; flags there belong to it.

With --json, a foreground exec prints {"handle","exit_code","stdout","stderr"} when
the command has finished and still exits with its exit code; -d prints the process
record.`,
		Example: `  cairn exec $id -- python3 -c 'print(1)'
  cairn exec -e LANG=C.UTF-8 -w /workspace $id -- ls -la
  echo 'print(6*7)' | cairn exec -i $id -- python3
  p=$(cairn exec -d $id -- python3 -i -u)
  cairn exec -it $id -- bash`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			// Flags stop at SANDBOX, so a "--" after it arrives as an argument.
			if args[1] == "--" {
				args = append(args[:1:1], args[2:]...)
			}
			if len(args) < 2 {
				return errdefs.InvalidArgument("exec needs a command after the sandbox ID")
			}
			env, err := parseEnv(fl.env)
			if err != nil {
				return err
			}
			opts := client.ExecRequest{Args: args[1:], Env: env, Cwd: fl.cwd, Tty: fl.tty}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			if fl.detach {
				return execDetached(a, cmd, e, args[0], opts)
			}
			return execForeground(a, cmd, e, args[0], opts, fl.interactive, fl.keep)
		},
	}
	f := cmd.Flags()
	f.SetInterspersed(false)
	f.BoolVarP(&fl.detach, "detach", "d", false, "start in the background and print the process handle")
	f.BoolVarP(&fl.tty, "tty", "t", false, "run the command on a pseudo-terminal")
	f.BoolVarP(&fl.interactive, "interactive", "i", false, "copy cairn's standard input to the command (foreground)")
	f.BoolVar(&fl.keep, "keep", false, "keep the record of a foreground command (output, exit status) after it exits")
	f.StringArrayVarP(&fl.env, "env", "e", nil, "environment variable K=V, or K to copy cairn's value (repeatable)")
	f.StringVarP(&fl.cwd, "workdir", "w", "", "working directory inside the sandbox")
	return cmd
}

// parseEnv checks K=V pairs; a bare K takes the value from cairn's environment.
func parseEnv(pairs []string) ([]string, error) {
	out := make([]string, 0, len(pairs))
	for _, p := range pairs {
		k, _, ok := strings.Cut(p, "=")
		if k == "" {
			return nil, errdefs.InvalidArgument("environment variable %q: write it as KEY=VALUE", p)
		}
		if !ok {
			p = k + "=" + os.Getenv(k)
		}
		out = append(out, p)
	}
	return out, nil
}

func execDetached(a *app, cmd *cobra.Command, e client.Backend, id string, opts client.ExecRequest) error {
	p, err := e.Spawn(cmd.Context(), id, opts)
	if err != nil {
		return err
	}
	if !a.json {
		fmt.Fprintln(cmd.OutOrStdout(), p.Handle)
		return nil
	}
	return printJSON(cmd.OutOrStdout(), p)
}

// execForeground starts the process, gives it cairn's standard input (interactive) or
// an empty one, and follows its output to its exit; its record is then removed unless
// keep.
func execForeground(a *app, cmd *cobra.Command, e client.Backend, id string, opts client.ExecRequest, interactive, keep bool) error {
	ctx := cmd.Context()
	p, err := e.Spawn(ctx, id, opts)
	if err != nil {
		return err
	}
	h := p.Handle
	if !interactive {
		// A process that already exited refuses the close: nothing to do then.
		e.Stdin(ctx, id, h, nil, true)
	} else {
		if opts.Tty {
			if restore := rawTerminal(os.Stdin); restore != nil {
				defer restore()
			}
		}
		go pumpStdin(ctx, e, id, h, os.Stdin)
	}
	var stdout, stderr io.Writer = cmd.OutOrStdout(), cmd.ErrOrStderr()
	var bufOut, bufErr bytes.Buffer
	if a.json {
		stdout, stderr = &bufOut, &bufErr
	}
	st, err := e.Follow(ctx, id, h, stdout, stderr)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, context.Canceled) {
			return stopProcess(ctx, e, id, h)
		}
		return err
	}
	if !keep {
		// Housekeeping: a record left behind only costs room, so a failure is not the
		// command's.
		e.RemoveProcess(ctx, id, h)
	}
	if a.json {
		doc := map[string]any{"handle": h, "exit_code": st.Code}
		if st.Signal != 0 {
			doc["signal"] = st.Signal
		}
		textOrBase64(doc, "stdout", bufOut.Bytes())
		textOrBase64(doc, "stderr", bufErr.Bytes())
		if err := printJSON(cmd.OutOrStdout(), doc); err != nil {
			return err
		}
	}
	if st.Code != 0 {
		return &exitError{code: st.Code}
	}
	return nil
}

// stopProcess ends a foreground process after cairn was interrupted: SIGTERM, then
// SIGKILL if it is still running two seconds later.
func stopProcess(ctx context.Context, e client.Backend, id, h string) error {
	ctx = context.WithoutCancel(ctx)
	e.Signal(ctx, id, h, syscall.SIGTERM)
	wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := e.Wait(wctx, id, h); err == nil {
		return fmt.Errorf("interrupted; process %s terminated: %w", h, context.Canceled)
	}
	e.Signal(ctx, id, h, syscall.SIGKILL)
	return fmt.Errorf("interrupted; process %s killed: %w", h, context.Canceled)
}

// pumpStdin copies r to the process's stdin until end of input, then closes it.
func pumpStdin(ctx context.Context, e client.Backend, id, h string, r io.Reader) {
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if e.Stdin(ctx, id, h, buf[:n], false) != nil {
				return // the process exited or stopped reading
			}
		}
		if err != nil {
			e.Stdin(ctx, id, h, nil, true)
			return
		}
	}
}

// rawTerminal puts f in raw mode when it is a terminal and returns the restore
// function (nil if f is not a terminal).
func rawTerminal(f *os.File) func() {
	fd := int(f.Fd())
	old, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return nil
	}
	raw := *old
	raw.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	raw.Oflag &^= unix.OPOST
	raw.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	raw.Cflag &^= unix.CSIZE | unix.PARENB
	raw.Cflag |= unix.CS8
	raw.Cc[unix.VMIN], raw.Cc[unix.VTIME] = 1, 0
	if unix.IoctlSetTermios(fd, unix.TCSETS, &raw) != nil {
		return nil
	}
	return func() { unix.IoctlSetTermios(fd, unix.TCSETS, old) }
}
