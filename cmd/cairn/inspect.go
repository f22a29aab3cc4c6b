package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func newInspectCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect SANDBOX|CHECKPOINT",
		Short: "Show the details of a sandbox or a checkpoint",
		Long: `Inspect shows everything cairn records about a sandbox (including its processes)
or, if no sandbox has that ID, about a checkpoint.

With --json: {"kind": "sandbox", "sandbox": {...}, "processes": [...]} or
{"kind": "checkpoint", "checkpoint": {...}}.`,
		Example: `  cairn inspect $id
  cairn inspect $c1
  cairn inspect --json $id | jq .sandbox.state`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			doc, err := lookup(cmd.Context(), e, args[0])
			if err != nil {
				return err
			}
			return emit(a, cmd, doc, func(w io.Writer) error {
				if ck, ok := doc["checkpoint"].(*model.Checkpoint); ok {
					return describeCheckpoint(w, ck)
				}
				return describeSandbox(w, doc["sandbox"].(*client.Sandbox), doc["processes"].([]*model.Process))
			})
		},
	}
}

// lookup finds id as a sandbox, else as a checkpoint.
func lookup(ctx context.Context, e client.Backend, id string) (map[string]any, error) {
	sb, err := e.Get(ctx, id)
	if err == nil {
		ps, err := e.Processes(ctx, id)
		if err != nil {
			return nil, err
		}
		if ps == nil {
			ps = []*model.Process{}
		}
		return map[string]any{"kind": "sandbox", "sandbox": sb, "processes": ps}, nil
	}
	if errdefs.Code(err) != "not_found" {
		return nil, err
	}
	ck, err := e.GetCheckpoint(ctx, id)
	if errdefs.Code(err) == "not_found" {
		return nil, errdefs.NotFound("no sandbox or checkpoint %q (list sandboxes with `cairn ls`, checkpoints with `cairn tree SANDBOX`)", id)
	}
	if err != nil {
		return nil, err
	}
	return map[string]any{"kind": "checkpoint", "checkpoint": ck}, nil
}

// kv prints aligned "Key: value" lines.
func kv(w io.Writer, pairs ...string) error {
	t := newTable(w)
	for i := 0; i+1 < len(pairs); i += 2 {
		t.row(pairs[i]+":", pairs[i+1])
	}
	return t.flush()
}

func limitsString(l model.Sandbox) string {
	var parts []string
	if l.Limits.MemoryBytes > 0 {
		parts = append(parts, "memory "+humanSize(l.Limits.MemoryBytes))
	}
	if l.Limits.Pids > 0 {
		parts = append(parts, fmt.Sprintf("pids %d", l.Limits.Pids))
	}
	if l.Limits.CPUs > 0 {
		parts = append(parts, fmt.Sprintf("cpus %g", l.Limits.CPUs))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func describeSandbox(w io.Writer, sb *client.Sandbox, ps []*model.Process) error {
	running := 0
	for _, p := range ps {
		if p.Running {
			running++
		}
	}
	return kv(w,
		"ID", sb.ID,
		"Template", orDash(sb.Template),
		"Isolation", sb.Isolation,
		"State", sb.State,
		"Hostname", sb.Hostname,
		"Head", orDash(sb.Head),
		"Origin", orDash(sb.Origin),
		"Labels", orDash(labelString(sb.Labels)),
		"Limits", limitsString(sb.Sandbox),
		"Created", sb.CreatedAt.Local().Format("2006-01-02 15:04:05")+" ("+humanTime(sb.CreatedAt)+")",
		"Root", sb.Root,
		"Init pid", fmt.Sprint(sb.Init.Pid),
		"Processes", fmt.Sprintf("%d (%d running; list them with `cairn ps %s`)", len(ps), running, sb.ID),
		"Resident", fmt.Sprintf("%d checkpoints, whose zygotes hold %s beyond its processes' memory (it counts against its memory limit)", sb.ResidentCheckpoints, humanSize(sb.ResidentMemoryBytes)),
		"Session", orDash(sb.SessionID),
		"Run", orDash(sb.RunID),
		"Expires", expiry(sb),
	)
}

func describeCheckpoint(w io.Writer, ck *model.Checkpoint) error {
	return kv(w,
		"ID", ck.ID,
		"Sandbox", ck.SandboxID,
		"Parent", orDash(ck.Parent),
		"Label", orDash(ck.Label),
		"Created", ck.CreatedAt.Local().Format("2006-01-02 15:04:05")+" ("+humanTime(ck.CreatedAt)+")",
		"Image size", humanSize(ck.ImageBytes),
		"Duration", fmt.Sprintf("%.1f ms", ck.DurationMS),
		"Method", method(ck),
		"Resident", resident(ck),
		"FS volume", ck.FSVolume,
		"Images", ck.Images,
	)
}

// method renders how a checkpoint's processes are stored; incremental images name the
// chain they read through.
func method(ck *model.Checkpoint) string {
	if ck.MethodReason != "" {
		return ck.Method + ": " + ck.MethodReason
	}
	if ck.ImagesDepth > 0 {
		return fmt.Sprintf("%s (pages shared with parent %s; chain depth %d)", ck.Method, ck.Parent, ck.ImagesDepth)
	}
	return ck.Method
}

// resident says whether a checkpoint's processes are held by zygotes, and the memory
// only they hold.
func resident(ck *model.Checkpoint) string {
	if !ck.Resident {
		return "no"
	}
	return "yes: its zygotes alone hold " + humanSize(ck.ResidentMemoryBytes) + " (freed if they are evicted)"
}

// expiry renders a sandbox's TTL ("-" without a daemon).
func expiry(sb *client.Sandbox) string {
	if sb.ExpiresAt.IsZero() {
		return "-"
	}
	return sb.ExpiresAt.Local().Format("2006-01-02 15:04:05") + " (" + sb.ExpiryPolicy + ")"
}
