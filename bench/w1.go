package bench

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
)

// engineTransport reaches a REPL started with Engine.Exec.
type engineTransport struct {
	e          *engine.Engine
	id, handle string
}

func (t engineTransport) write(ctx context.Context, data []byte) error {
	return t.e.Stdin(ctx, t.id, t.handle, data, false)
}

func (t engineTransport) output(ctx context.Context, off int64) ([]byte, int64, error) {
	return t.e.Output(ctx, t.id, t.handle, "stdout", off)
}

// w1 is the live W1 sandbox.
type w1 struct {
	e      *engine.Engine
	id     string // sandbox
	bash   string // handle of the idle shell
	py     string // handle of the REPL
	repl   *repl
	steps  int
	expect map[string]expected // by checkpoint ID
	parent map[string]string   // checkpoint → the head it was taken from
	// ckPhases, if set, receives the phases of each checkpoint (bench's traced).
	ckPhases map[string][]float64
	// replMS is how long the REPL's statement of the last step took (ms).
	replMS float64
}

// expected is the state of the sandbox recorded just before a checkpoint.
type expected struct {
	REPL      replState
	GitStatus string
	StdoutOff int64 // where the REPL's stdout ended (it is rolled back with the root)
}

const (
	repoDir = "/workspace/repo"
	dbPath  = "/workspace/db.sqlite"
	// repoScript makes a git repository of 1,000 small text files with 20 commits.
	repoScript = `set -e
mkdir -p ` + repoDir + ` && cd ` + repoDir + `
git init -q -b main .
git config user.email bench@cairn.invalid
git config user.name "cairn bench"
for i in $(seq -w 0 999); do printf 'file %s\nline 1\n' "$i" > "f$i.txt"; done
git add -A && git commit -q -m "commit 1"
for c in $(seq 2 20); do
  for i in $(seq 0 49); do echo "commit $c" >> "$(printf 'f%03d.txt' $(( (c * 50 + i) % 1000 )))"; done
  git add -A && git commit -q -m "commit $c"
done
`
)

// run executes a foreground command in sandbox id and returns its stdout; a non-zero
// exit is an error carrying stderr.
func run(ctx context.Context, e *engine.Engine, id string, args ...string) (string, error) {
	h, err := e.Exec(ctx, id, model.ExecOptions{Args: args, NoStdin: true})
	if err != nil {
		return "", err
	}
	st, err := e.Wait(ctx, id, h)
	if err != nil {
		return "", err
	}
	out, _, err := e.Output(ctx, id, h, "stdout", 0)
	if err != nil {
		return "", err
	}
	if st.Code != 0 || st.Signal != 0 {
		msg, _, _ := e.Output(ctx, id, h, "stderr", 0)
		return "", fmt.Errorf("%s: exit %d signal %d: %s", strings.Join(args, " "), st.Code, st.Signal, tail(msg, 400))
	}
	// As a foreground exec of cairn's CLI and API does: the record goes once read.
	if err := e.RemoveProcess(ctx, id, h); err != nil {
		return "", err
	}
	return string(out), nil
}

// setupW1 creates the W1 sandbox from template "debian" and brings it to W1's state.
func setupW1(ctx context.Context, e *engine.Engine, iso string) (*w1, error) {
	sb, err := e.Create(ctx, model.CreateOptions{Template: "debian", Isolation: iso, Labels: map[string]string{"bench": "w1"}})
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	w := &w1{e: e, id: sb.ID, expect: map[string]expected{}, parent: map[string]string{}}
	if _, err := run(ctx, e, w.id, "bash", "-c", repoScript); err != nil {
		return w, fmt.Errorf("repo setup: %w", err)
	}
	if w.bash, err = e.Exec(ctx, w.id, model.ExecOptions{Args: []string{"bash"}}); err != nil {
		return w, fmt.Errorf("idle bash: %w", err)
	}
	if err := e.Stdin(ctx, w.id, w.bash, []byte("cd "+repoDir+"; export FOO=bar\n"), false); err != nil {
		return w, fmt.Errorf("idle bash: %w", err)
	}
	if w.py, err = e.Exec(ctx, w.id, model.ExecOptions{Args: []string{"python3", "-i", "-u"}, Cwd: "/workspace"}); err != nil {
		return w, fmt.Errorf("repl: %w", err)
	}
	w.repl = &repl{t: engineTransport{e, w.id, w.py}}
	if err := w.repl.setupW1(ctx, dbPath); err != nil {
		return w, fmt.Errorf("repl setup: %w", err)
	}
	return w, nil
}

// stepScript edits 3 files of the repository and stages one of them.
func stepScript(n int) string {
	f := func(k int) string { return fmt.Sprintf("f%03d.txt", (n*7919+k*331)%1000) }
	return fmt.Sprintf("cd %s && echo 'step %d edit' >> %s && echo 'step %d edit' >> %s && echo 'step %d edit' >> %s && git add %s",
		repoDir, n, f(0), n, f(1), n, f(2), f(0))
}

// step runs one W1 step: 3 file edits, `git add` of one, ~1 MiB of heap, 10 rows.
func (w *w1) step(ctx context.Context) error {
	w.steps++
	if _, err := run(ctx, w.e, w.id, "bash", "-c", stepScript(w.steps)); err != nil {
		return fmt.Errorf("step %d: %w", w.steps, err)
	}
	t := time.Now()
	if err := w.repl.step(ctx, w.steps); err != nil {
		return fmt.Errorf("step %d: %w", w.steps, err)
	}
	w.replMS = ms(time.Since(t))
	return nil
}

// record captures what the next checkpoint must bring back.
func (w *w1) record(ctx context.Context) (expected, error) {
	st, err := w.repl.probe(ctx)
	if err != nil {
		return expected{}, err
	}
	gs, err := run(ctx, w.e, w.id, "git", "-C", repoDir, "status", "--porcelain")
	if err != nil {
		return expected{}, err
	}
	return expected{REPL: st, GitStatus: gs, StdoutOff: w.repl.off}, nil
}

// check verifies that sandbox id (the W1 sandbox after a rollback, or a fork) is in the
// state recorded for its checkpoint. For the W1 sandbox itself, pass w.repl so that its
// stdout offset follows the rollback.
func (w *w1) check(ctx context.Context, id string, r *repl, want expected) error {
	if r == nil {
		r = &repl{t: engineTransport{w.e, id, w.py}}
	}
	r.off = want.StdoutOff
	if err := r.verify(ctx, want.REPL); err != nil {
		return err
	}
	gs, err := run(ctx, w.e, id, "git", "-C", repoDir, "status", "--porcelain")
	if err != nil {
		return err
	}
	if gs != want.GitStatus {
		return fmt.Errorf("git status %q, want %q", tail([]byte(gs), 300), tail([]byte(want.GitStatus), 300))
	}
	return nil
}
