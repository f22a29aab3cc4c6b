package api

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// metrics are the daemon's Prometheus metrics, in a registry of their own.
type metrics struct {
	reg      *prometheus.Registry
	opDur    *prometheus.HistogramVec
	opCount  *prometheus.CounterVec
	httpDur  *prometheus.HistogramVec
	httpReqs *prometheus.CounterVec
	streams  prometheus.Gauge
}

// latencyBuckets span a 1 ms file read to a multi-minute template build.
var latencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 180}

func newMetrics(s *Server) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		opDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "cairn_operation_duration_seconds", Help: "Latency of engine operations by op.", Buckets: latencyBuckets,
		}, []string{"op"}),
		opCount: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cairn_operations_total", Help: "Engine operations by op and result code (ok or an errdefs code).",
		}, []string{"op", "code"}),
		httpDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "cairn_http_request_duration_seconds", Help: "Latency of API requests by route (streams included).", Buckets: latencyBuckets,
		}, []string{"route"}),
		httpReqs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cairn_http_requests_total", Help: "API requests by route and status code.",
		}, []string{"route", "code"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{Name: "cairn_streams", Help: "Open output and event streams."}),
	}
	m.reg.MustRegister(m.opDur, m.opCount, m.httpDur, m.httpReqs, m.streams,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&stateCollector{s: s})
	return m
}

// observe records one engine operation.
func (m *metrics) observe(op string, start time.Time, err error) {
	code := "ok"
	if err != nil {
		code = errdefs.Code(err)
	}
	m.opDur.WithLabelValues(op).Observe(time.Since(start).Seconds())
	m.opCount.WithLabelValues(op, code).Inc()
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// stateCollector reports, at scrape time, sandboxes by state, sessions, event
// subscribers, pool usage and the standby cache.
type stateCollector struct{ s *Server }

var (
	sandboxesDesc   = prometheus.NewDesc("cairn_sandboxes", "Sandboxes by state (running, stopped, paused).", []string{"state"}, nil)
	sessionsDesc    = prometheus.NewDesc("cairn_sessions", "Sandboxes whose lifetime the daemon tracks.", nil, nil)
	subscribersDesc = prometheus.NewDesc("cairn_event_subscribers", "Open GET /v1/events streams.", nil, nil)
	poolDesc        = prometheus.NewDesc("cairn_pool_bytes", "Size and free space of the btrfs pool.", []string{"kind"}, nil)
	standbysDesc    = prometheus.NewDesc("cairn_standbys", "Standbys held: checkpoints restored ahead of time, frozen, ready for a rollback or fork.", nil, nil)
	standbyMemDesc  = prometheus.NewDesc("cairn_standby_memory_bytes", "Memory the standbys hold (bounded by the engine's standby budget).", nil, nil)
	residentMemDesc = prometheus.NewDesc("cairn_resident_memory_bytes", "Memory the zygotes of resident checkpoints hold beyond their sandboxes' processes (bounded per sandbox by the engine's ResidentMemory).", nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- sandboxesDesc
	ch <- sessionsDesc
	ch <- subscribersDesc
	ch <- poolDesc
	ch <- standbysDesc
	ch <- standbyMemDesc
	ch <- residentMemDesc
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts := map[string]int{"running": 0, "stopped": 0, "paused": 0}
	if sbs, err := c.s.eng.List(ctx); err == nil {
		for _, sb := range sbs {
			state := sb.State
			if rec, ok := c.s.sessions.snapshot(sb.ID); ok && rec.PausedReason != "" && state == "stopped" {
				state = "paused"
			}
			counts[state]++
		}
	}
	for state, n := range counts {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), state)
	}
	ch <- prometheus.MustNewConstMetric(sessionsDesc, prometheus.GaugeValue, float64(c.s.sessions.count()))
	ch <- prometheus.MustNewConstMetric(subscribersDesc, prometheus.GaugeValue, float64(c.s.broker.count()))
	if n, bytes, err := c.s.eng.StandbyMemory(ctx); err == nil {
		ch <- prometheus.MustNewConstMetric(standbysDesc, prometheus.GaugeValue, float64(n))
		ch <- prometheus.MustNewConstMetric(standbyMemDesc, prometheus.GaugeValue, float64(bytes))
	}
	if bytes, err := c.s.eng.ResidentMemory(ctx); err == nil {
		ch <- prometheus.MustNewConstMetric(residentMemDesc, prometheus.GaugeValue, float64(bytes))
	}
	var st unix.Statfs_t
	if unix.Statfs(c.s.poolDir, &st) == nil {
		bs := float64(st.Bsize)
		ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, float64(st.Blocks)*bs, "size")
		ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, float64(st.Bavail)*bs, "free")
	}
}

// statusRecorder remembers the status a handler wrote, for the request metrics.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func (r *statusRecorder) code() string {
	if r.status == 0 {
		return "200"
	}
	return strconv.Itoa(r.status)
}
