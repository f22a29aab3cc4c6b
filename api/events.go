package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// subscriberBuffer is how far a subscriber may fall behind before it is dropped.
const subscriberBuffer = 1024

// broker fans lifecycle events out to the subscribers of GET /v1/events.
type broker struct {
	mu   sync.Mutex
	seq  uint64                   // protected by mu
	subs map[*subscriber]struct{} // protected by mu
}

type subscriber struct {
	match  func(*client.Event) bool
	ch     chan *client.Event
	lagged bool // protected by broker.mu; ch is closed when set
}

func newBroker() *broker { return &broker{subs: map[*subscriber]struct{}{}} }

// publish stamps ev and delivers it without ever blocking: a subscriber whose buffer
// is full is dropped (it sees its channel closed and reports "lagged").
func (b *broker) publish(ev client.Event) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.seq++
	ev.Seq, ev.Time = b.seq, time.Now().UTC()
	for s := range b.subs {
		if !s.match(&ev) {
			continue
		}
		select {
		case s.ch <- &ev:
		default:
			s.lagged = true
			close(s.ch)
			delete(b.subs, s)
		}
	}
}

func (b *broker) subscribe(match func(*client.Event) bool) *subscriber {
	s := &subscriber{match: match, ch: make(chan *client.Event, subscriberBuffer)}
	b.mu.Lock()
	b.subs[s] = struct{}{}
	b.mu.Unlock()
	return s
}

func (b *broker) unsubscribe(s *subscriber) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.subs[s]; ok {
		delete(b.subs, s)
		close(s.ch)
	}
}

func (b *broker) count() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.subs)
}

// eventFilter builds the match function of GET /v1/events's query.
func eventFilter(r *http.Request) (func(*client.Event) bool, error) {
	q := r.URL.Query()
	labels, err := labelQuery(q["label"])
	if err != nil {
		return nil, err
	}
	sandboxes, types, session := q["sandbox"], q["type"], q.Get("session")
	for _, t := range types {
		if !slices.Contains(eventTypes, t) {
			return nil, errdefs.InvalidArgument("event type %q: give one of %v", t, eventTypes)
		}
	}
	return func(ev *client.Event) bool {
		return (len(sandboxes) == 0 || slices.Contains(sandboxes, ev.SandboxID)) &&
			(len(types) == 0 || slices.Contains(types, ev.Type)) &&
			(session == "" || ev.SessionID == session) &&
			hasLabels(ev.Labels, labels)
	}, nil
}

var eventTypes = []string{client.EventCreated, client.EventCheckpointed, client.EventRolledBack, client.EventForked,
	client.EventPaused, client.EventResumed, client.EventStopped, client.EventExpired, client.EventDestroyed}

// events serves GET /v1/events as server-sent events.
func (s *Server) events(w http.ResponseWriter, r *http.Request) error {
	match, err := eventFilter(r)
	if err != nil {
		return err
	}
	sub := s.broker.subscribe(match)
	defer s.broker.unsubscribe(sub)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	fmt.Fprint(w, ": cairnd events\n\n")
	rc.Flush()
	keepalive := time.NewTicker(15 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case <-r.Context().Done():
			return nil
		case <-s.done:
			return nil
		case <-keepalive.C:
			fmt.Fprint(w, ": keepalive\n\n")
		case ev, ok := <-sub.ch:
			if !ok {
				fmt.Fprint(w, "event: lagged\ndata: {}\n\n")
				rc.Flush()
				return nil
			}
			data, _ := json.Marshal(ev)
			fmt.Fprintf(w, "id: %d\nevent: %s\ndata: %s\n\n", ev.Seq, ev.Type, data)
		}
		if rc.Flush() != nil {
			return nil
		}
	}
}
