// Command cairn-init is PID 1 of a container sandbox.
//
// It runs in two stages. "cairn-init setup" is started by cairn from the host's copy of
// the binary, already inside the sandbox's new pid, mount, net, ipc and uts namespaces;
// it waits until cairn has placed it in its cgroups, enters a new cgroup namespace,
// builds the sandbox's mounts, pivots into the root, configures hostname and loopback,
// installs the seccomp filter, drops capabilities and execs "/.cairn/init serve" — the
// copy inside the sandbox root, so that every file the process tree maps is inside the
// sandbox and CRIU can dump it. "serve" then starts, signals and reaps processes on
// requests of the protocol described in package initctl.
//
// In a gVisor sandbox the OCI runtime builds the sandbox, and "cairn-init boot" (serve
// with its stdio moved inside the sandbox) is PID 1. The host cannot reach that
// sandbox's FIFOs, so it runs the client stages "request", "stdin" and "hostname" inside
// it with `runsc exec` (see client.go).
package main

import (
	"errors"
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "cairn-init is started by cairn; usage: cairn-init setup|serve|boot|request|stdin|hostname")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "setup":
		err = setup()
	case "serve":
		err = serve()
	case "boot":
		err = boot()
	case "request":
		err = request()
	case "stdin":
		err = stdin(os.Args[2:])
	case "hostname":
		err = hostname(os.Args[2:])
	default:
		err = fmt.Errorf("unknown stage %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "cairn-init %s: %v\n", os.Args[1], err)
		var ce *clientError
		if errors.As(err, &ce) {
			os.Exit(ce.code)
		}
		os.Exit(1)
	}
}
