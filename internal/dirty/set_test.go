package dirty

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestSet(t *testing.T) {
	// r builds a set from pairs, in the order given (not normalised).
	r := func(bounds ...uint64) Set {
		var s Set
		for i := 0; i < len(bounds); i += 2 {
			s = append(s, Range{bounds[i], bounds[i+1]})
		}
		return s
	}
	cases := []struct {
		name                       string
		a, b                       Set
		union, intersect, subtract Set
	}{
		{name: "empty"},
		{
			name:  "one side empty",
			a:     r(10, 20),
			union: r(10, 20), subtract: r(10, 20),
		},
		{
			name: "disjoint",
			a:    r(10, 20), b: r(30, 40),
			union: r(10, 20, 30, 40), subtract: r(10, 20),
		},
		{
			name: "adjacent ranges merge",
			a:    r(10, 20), b: r(20, 30),
			union: r(10, 30), subtract: r(10, 20),
		},
		{
			name: "overlap",
			a:    r(10, 30), b: r(20, 40),
			union: r(10, 40), intersect: r(20, 30), subtract: r(10, 20),
		},
		{
			name: "hole punched",
			a:    r(10, 50), b: r(20, 30),
			union: r(10, 50), intersect: r(20, 30), subtract: r(10, 20, 30, 50),
		},
		{
			name: "several holes, one range spanning several",
			a:    r(0, 100), b: r(10, 20, 30, 40, 90, 120),
			union: r(0, 120), intersect: r(10, 20, 30, 40, 90, 100), subtract: r(0, 10, 20, 30, 40, 90),
		},
		{
			name: "equal",
			a:    r(10, 20, 30, 40), b: r(10, 20, 30, 40),
			union: r(10, 20, 30, 40), intersect: r(10, 20, 30, 40),
		},
		{
			name: "inputs not normalised: unsorted, overlapping, adjacent, empty ranges",
			a:    r(30, 40, 10, 20, 15, 25, 25, 28, 50, 50), b: r(35, 36, 5, 12, 12, 12),
			union: r(5, 28, 30, 40), intersect: r(10, 12, 35, 36), subtract: r(12, 28, 30, 35, 36, 40),
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if diff := cmp.Diff(c.union, c.a.Union(c.b)); diff != "" {
				t.Errorf("Union (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(c.union, c.b.Union(c.a)); diff != "" {
				t.Errorf("Union, swapped (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(c.intersect, c.a.Intersect(c.b)); diff != "" {
				t.Errorf("Intersect (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(c.intersect, c.b.Intersect(c.a)); diff != "" {
				t.Errorf("Intersect, swapped (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(c.subtract, c.a.Subtract(c.b)); diff != "" {
				t.Errorf("Subtract (-want +got):\n%s", diff)
			}
			// Identities: a = (a - b) + (a & b), disjointly.
			if diff := cmp.Diff(c.a.Union(nil), c.a.Subtract(c.b).Union(c.a.Intersect(c.b))); diff != "" {
				t.Errorf("(a-b)+(a&b) differs from a (-want +got):\n%s", diff)
			}
			if got, want := c.a.Bytes(), c.a.Subtract(c.b).Bytes()+c.a.Intersect(c.b).Bytes(); got != want {
				t.Errorf("Bytes of a = %d, of its parts %d", got, want)
			}
		})
	}
}

func TestSetBytes(t *testing.T) {
	s := Set{{0, 4096}, {8192, 16384}}
	if got := s.Bytes(); got != 12288 {
		t.Errorf("Bytes = %d, want 12288", got)
	}
	if got := (Set{{0, 4096}, {0, 4096}}).Bytes(); got != 4096 {
		t.Errorf("Bytes of a range given twice = %d, want 4096", got)
	}
}

// TestSetDoesNotAlias: the operations leave their operands as they were.
func TestSetDoesNotAlias(t *testing.T) {
	a := Set{{30, 40}, {10, 20}}
	b := Set{{15, 35}}
	a.Union(b)
	a.Intersect(b)
	a.Subtract(b)
	if diff := cmp.Diff(Set{{30, 40}, {10, 20}}, a); diff != "" {
		t.Errorf("operand changed (-before +after):\n%s", diff)
	}
}

// TestUnionMerge: the one-pass Union of normalised sets gives what sorting the two
// together gives, on random sets (overlapping, adjacent, nested, empty), and its result
// shares no room with its operands that an append could write into.
func TestUnionMerge(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 7))
	random := func(n int) Set {
		var s Set
		for i := 0; i < n; i++ {
			a := uint64(rng.IntN(512)) * 4096
			s = append(s, Range{a, a + uint64(1+rng.IntN(8))*4096})
		}
		return normalise(s)
	}
	for i := 0; i < 2000; i++ {
		a, b := random(rng.IntN(40)), random(rng.IntN(40))
		want := normalise(append(append(Set{}, a...), b...))
		got := a.Union(b)
		if !cmp.Equal(got, want) {
			t.Fatalf("%v ∪ %v = %v, want %v", a, b, got, want)
		}
		if !got.normalised() {
			t.Fatalf("%v ∪ %v = %v: not normalised", a, b, got)
		}
		aa, bb := slices.Clone(a), slices.Clone(b)
		_ = append(got, Range{1 << 40, 1<<40 + 4096})
		if !cmp.Equal(a, aa) || !cmp.Equal(b, bb) {
			t.Fatalf("an append to %v ∪ %v changed an operand", aa, bb)
		}
	}
}
