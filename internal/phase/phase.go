// Package phase carries a recorder of where an operation's time goes through a context,
// across the layers it runs in (engine, isolation backend, storage), the way
// net/http/httptrace carries a ClientTrace. Operations that are not traced pay one
// context lookup per phase.
package phase

import (
	"context"
	"time"
)

// Func is told how long the phase name took. It may be called from several goroutines
// of one operation at once (phases that overlap), so it must be safe for that.
type Func func(name string, d time.Duration)

type key struct{}

// With returns a context whose operations report their phases to f.
func With(ctx context.Context, f Func) context.Context {
	return context.WithValue(ctx, key{}, f)
}

// Of returns the recorder of ctx, nil if none.
func Of(ctx context.Context) Func {
	f, _ := ctx.Value(key{}).(Func)
	return f
}

// Since reports the phase name as having started at start and ended now.
func Since(ctx context.Context, name string, start time.Time) {
	if f := Of(ctx); f != nil {
		f(name, time.Since(start))
	}
}
