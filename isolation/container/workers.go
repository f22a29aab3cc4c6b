package container

import (
	"fmt"
	"slices"
	"sync"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/isolation"
)

// CRIU workers started ahead. A checkpoint's CRIU dump begins with CRIU starting up
// (~25 ms on an idle machine of this kind, inside the freeze); a sandbox that has been
// checkpointed is likely to be checkpointed again, so after each checkpoint (and after a
// rollback gives such a sandbox a new tree) a worker for its next dump is started in the
// background and kept idle. A worker joins the tree's network namespace when it starts,
// so it serves only the tree it was started for.

// maxWorkers bounds the idle workers (each an idle CRIU process holding its sandbox's
// network namespace); past it the oldest is stopped.
const maxWorkers = 32

type workerPool struct {
	mu    sync.Mutex
	byID  map[string]*poolWorker
	order []string // sandbox IDs, oldest first
}

type poolWorker struct {
	init  isolation.Proc
	w     *criu.Worker // nil while starting, or if it failed to start
	done  chan struct{}
	taken bool // by a checkpoint (or a tombstone left by stopped): not the pool's to close
}

func netnsOf(init isolation.Proc) string { return fmt.Sprintf("/proc/%d/ns/net", init.Pid) }

// take returns the worker started for sb's current tree, waiting for one being started,
// or nil. The worker is the caller's; the sandbox keeps its place in the pool.
func (p *workerPool) take(sb *isolation.Sandbox) *criu.Worker {
	p.mu.Lock()
	pw := p.byID[sb.ID]
	if pw == nil || pw.init != sb.Init || pw.taken {
		p.mu.Unlock()
		return nil
	}
	pw.taken = true
	p.mu.Unlock()
	<-pw.done
	return pw.w
}

// start begins starting a worker for sb's current tree, replacing one started for
// another tree, unless one for this tree is there. With onlyKnown, it does so only for
// a sandbox the pool knows (one that has checkpointed).
func (p *workerPool) start(sb *isolation.Sandbox, onlyKnown bool) {
	p.mu.Lock()
	old, known := p.byID[sb.ID]
	if onlyKnown && !known || known && old.init == sb.Init && !old.taken {
		p.mu.Unlock()
		return
	}
	pw := &poolWorker{init: sb.Init, done: make(chan struct{})}
	if p.byID == nil {
		p.byID = map[string]*poolWorker{}
	}
	p.byID[sb.ID] = pw
	p.order = append(slices.DeleteFunc(p.order, func(id string) bool { return id == sb.ID }), sb.ID)
	var evicted []*poolWorker
	if known && !old.taken {
		evicted = append(evicted, old)
	}
	for len(p.order) > maxWorkers {
		if e := p.byID[p.order[0]]; !e.taken {
			evicted = append(evicted, e)
		}
		delete(p.byID, p.order[0])
		p.order = p.order[1:]
	}
	p.mu.Unlock()
	for _, e := range evicted {
		go closeWorker(e)
	}
	go func() {
		defer close(pw.done)
		if w, err := criu.StartWorker(netnsOf(sb.Init)); err == nil {
			pw.w = w
		}
	}()
}

// stopped stops the worker of sb's tree, which is being stopped. The sandbox stays
// known, so that a restore of it gets a worker again.
func (p *workerPool) stopped(sb *isolation.Sandbox) {
	p.mu.Lock()
	pw := p.byID[sb.ID]
	if pw == nil || pw.init != sb.Init {
		p.mu.Unlock()
		return
	}
	done := make(chan struct{})
	close(done)
	p.byID[sb.ID] = &poolWorker{done: done, taken: true}
	p.mu.Unlock()
	if !pw.taken {
		go closeWorker(pw)
	}
}

func closeWorker(pw *poolWorker) {
	<-pw.done
	if pw.w != nil {
		pw.w.Close()
	}
}

// Restore workers. A restore starts CRIU too; restores are not tied to a sandbox until
// they begin (each gets a new network namespace, which a worker can make ahead, and the
// sandbox's cgroups, which it joins when the restore begins), so one spare worker of each
// kind (background for standbys, at nice 19; foreground for rollbacks and forks) is kept
// started once a restore of that kind has run.
type restorePool struct {
	mu    sync.Mutex
	spare [2]*poolWorker // by kind: 0 foreground, 1 background
}

func kind(background bool) int {
	if background {
		return 1
	}
	return 0
}

// take returns the spare worker of the kind (waiting if it is still starting), or nil,
// and starts the next spare.
func (p *restorePool) take(background bool) *criu.Worker {
	p.mu.Lock()
	pw := p.spare[kind(background)]
	next := &poolWorker{done: make(chan struct{})}
	p.spare[kind(background)] = next
	p.mu.Unlock()
	go func() {
		defer close(next.done)
		if w, err := criu.StartRestoreWorker(background); err == nil {
			next.w = w
		}
	}()
	if pw == nil {
		return nil
	}
	<-pw.done
	return pw.w
}

// Close stops the backend's idle CRIU workers (each holds a process and a network
// namespace) and its tracking of the sandboxes' writes (each tracked process has its
// memory registered with a userfaultfd of cairn's, which another engine, or CRIU, would
// find taken). The backend still works after it: later checkpoints and restores start
// CRIU themselves, and start new workers; rollbacks fork until a checkpoint tracks the
// processes again.
func (b *Backend) Close() error {
	b.res.untrackAll()
	b.workers.mu.Lock()
	var idle []*poolWorker
	for id, pw := range b.workers.byID {
		if !pw.taken {
			idle = append(idle, pw)
		}
		delete(b.workers.byID, id)
	}
	b.workers.order = nil
	b.workers.mu.Unlock()
	b.restorers.mu.Lock()
	for k, pw := range b.restorers.spare {
		if pw != nil {
			idle = append(idle, pw)
		}
		b.restorers.spare[k] = nil
	}
	b.restorers.mu.Unlock()
	for _, pw := range idle {
		closeWorker(pw)
	}
	return nil
}
