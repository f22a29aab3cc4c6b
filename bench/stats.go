package bench

import (
	"math"
	"sort"
)

// Stats summarizes samples: milliseconds for the *_ms fields, bytes for the storage
// fields. Percentiles use the nearest-rank method.
type Stats struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P95  float64 `json:"p95"`
	P99  float64 `json:"p99"`
	Min  float64 `json:"min"`
	Max  float64 `json:"max"`
}

// summarize computes the Stats of samples (the zero Stats for none).
func summarize(samples []float64) Stats {
	if len(samples) == 0 {
		return Stats{}
	}
	s := append([]float64(nil), samples...)
	sort.Float64s(s)
	var sum float64
	for _, v := range s {
		sum += v
	}
	rank := func(p float64) float64 {
		i := int(math.Ceil(p/100*float64(len(s)))) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return Stats{N: len(s), Mean: sum / float64(len(s)), P50: rank(50), P95: rank(95), P99: rank(99), Min: s[0], Max: s[len(s)-1]}
}

// ratio returns baseline / cairn, or 0 when either is unknown.
func ratio(baseline, cairn float64) float64 {
	if baseline <= 0 || cairn <= 0 {
		return 0
	}
	return baseline / cairn
}
