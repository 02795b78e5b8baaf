package lease

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sqllock/sqllock"
)

// Telemetry, through the OpenTelemetry API only: the instruments come from the global
// MeterProvider and TracerProvider (otel.SetMeterProvider, otel.SetTracerProvider),
// which record nothing until the application installs an SDK (or OpenTelemetry's
// eBPF auto-instrumentation takes the default tracer's spans); installed later, they
// still receive everything from then on (the global providers delegate). So the
// library always starts its spans and records its measurements: whether they go
// anywhere cannot be told through the API. Every strategy reports the same names,
// from here. The README lists them.

// Scope is the instrumentation scope of the library's meter and tracer.
const Scope = "github.com/sqllock/sqllock"

// The metric names and attribute keys.
const (
	MetricAcquisitions    = "sqllock.acquisitions"     // counter: acquire calls by result
	MetricAcquireDuration = "sqllock.acquire.duration" // histogram, s: Acquire call to return
	MetricHoldDuration    = "sqllock.hold.duration"    // histogram, s: grant to the lease's end
	MetricLosses          = "sqllock.losses"           // counter: held leases lost, by cause
	MetricHolders         = "sqllock.holders"          // up-down counter: leases held now
	MetricWaiters         = "sqllock.waiters"          // up-down counter: Acquire calls waiting now
	MetricRenewals        = "sqllock.renewals"         // counter: keep-alives by result
	MetricRenewalDuration = "sqllock.renewal.duration" // histogram, s: one keep-alive

	AttrStrategy  = "sqllock.strategy"    // uniqueindex, forupdate, advisory, optimistic, fairqueue
	AttrDBSystem  = "db.system.name"      // postgresql, mysql
	AttrOperation = "sqllock.operation"   // acquire, try_acquire
	AttrResult    = "sqllock.result"      // acquired, not_acquired, error; renewals: ok, lost, error
	AttrCause     = "sqllock.loss.cause"  // gone (the database said so), deadline (no keep-alive in time), release (found lost by Release)
	AttrEnd       = "sqllock.end"         // released, lost
	AttrNameHash  = "sqllock.name.sha256" // spans: the first 8 bytes of SHA-256(name), hex
	AttrName      = "sqllock.name"        // spans, instead of the hash, with the WithTelemetryNames options
	AttrToken     = "sqllock.token"       // spans: the granted token
)

type instruments struct {
	tracer       trace.Tracer
	acquisitions metric.Int64Counter
	acquireDur   metric.Float64Histogram
	holdDur      metric.Float64Histogram
	losses       metric.Int64Counter
	holders      metric.Int64UpDownCounter
	waiters      metric.Int64UpDownCounter
	renewals     metric.Int64Counter
	renewDur     metric.Float64Histogram
}

var tel = newInstruments()

func newInstruments() *instruments {
	m := otel.Meter(Scope)
	// Creating an instrument fails only for an invalid name or unit; the result is a
	// usable no-op instrument even then.
	i := &instruments{tracer: otel.Tracer(Scope)}
	i.acquisitions, _ = m.Int64Counter(MetricAcquisitions, metric.WithUnit("{acquisition}"),
		metric.WithDescription("Acquire and TryAcquire calls, by result."))
	i.acquireDur, _ = m.Float64Histogram(MetricAcquireDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from an Acquire or TryAcquire call to its return, waiting included."))
	i.holdDur, _ = m.Float64Histogram(MetricHoldDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from a grant to the end of the lease (released or lost)."))
	i.losses, _ = m.Int64Counter(MetricLosses, metric.WithUnit("{loss}"),
		metric.WithDescription("Held leases that ended lost, by cause."))
	i.holders, _ = m.Int64UpDownCounter(MetricHolders, metric.WithUnit("{lease}"),
		metric.WithDescription("Leases held now (reentrant holds of one lease count once)."))
	i.waiters, _ = m.Int64UpDownCounter(MetricWaiters, metric.WithUnit("{call}"),
		metric.WithDescription("Acquire calls waiting for a lock now."))
	i.renewals, _ = m.Int64Counter(MetricRenewals, metric.WithUnit("{renewal}"),
		metric.WithDescription("Keep-alives of held leases, by result."))
	i.renewDur, _ = m.Float64Histogram(MetricRenewalDuration, metric.WithUnit("s"),
		metric.WithDescription("Time one keep-alive took."))
	return i
}

// dbSystem is the OpenTelemetry name of the dialect's database.
func dbSystem(d sqllock.Dialect) string {
	if d == sqllock.MySQL {
		return "mysql"
	}
	return "postgresql"
}

// attrs returns the measurement option of the label's strategy and database plus
// the given key/value pairs (at most two), built once per combination: recording a
// measurement then allocates nothing, which matters most when no SDK is installed.
func (lb Label) attrs(kv ...string) metric.MeasurementOption {
	k := attrKey{strategy: lb.Strategy, dialect: lb.Dialect}
	copy(k.kv[:], kv)
	if o, ok := attrCache.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	list := []attribute.KeyValue{attribute.String(AttrStrategy, lb.Strategy), attribute.String(AttrDBSystem, dbSystem(lb.Dialect))}
	for i := 0; i+1 < len(kv); i += 2 {
		list = append(list, attribute.String(kv[i], kv[i+1]))
	}
	o, _ := attrCache.LoadOrStore(k, metric.WithAttributeSet(attribute.NewSet(list...)))
	return o.(metric.MeasurementOption)
}

type attrKey struct {
	strategy string
	dialect  sqllock.Dialect
	kv       [4]string
}

// attrCache holds the measurement options by attrKey: a few dozen at most (strategies
// x databases x the attribute values, all constants of this package).
var attrCache sync.Map

// nameAttr identifies the lock in spans: by a hash of its name, which can carry user
// data, unless the Locker was told to record names.
func (lb Label) nameAttr() attribute.KeyValue {
	if lb.ExposeName {
		return attribute.String(AttrName, lb.Name)
	}
	h := sha256.Sum256([]byte(lb.Name))
	return attribute.String(AttrNameHash, hex.EncodeToString(h[:8]))
}

// Observed runs acquire, an acquisition of the lock lb names (blocking or not), under
// observation: a span (the context acquire gets carries it), the waiters gauge while
// a blocking one runs, the acquisitions counter and the acquire duration by result;
// a granted lease counts as held (Lease.MarkHeld) until it ends. held returns a
// granted lease's core and token.
func Observed[L any](ctx context.Context, lb Label, block bool,
	acquire func(context.Context) (L, error), held func(L) (*Lease, int64)) (L, error) {
	ctx, a := startAcquisition(ctx, lb, block)
	le, err := acquire(ctx)
	if err != nil {
		a.end(nil, 0, err)
		return le, err
	}
	core, tok := held(le)
	a.end(core, tok, nil)
	return le, nil
}

// acquisition is one Acquire or TryAcquire under observation.
type acquisition struct {
	label Label
	op    string
	block bool
	start time.Time
	span  trace.Span
}

// startAcquisition begins the observation of an acquisition (op "acquire" when it
// waits, "try_acquire" otherwise). The returned context carries its span.
func startAcquisition(ctx context.Context, lb Label, block bool) (context.Context, *acquisition) {
	a := &acquisition{label: lb, op: "try_acquire", block: block, start: time.Now()}
	if block {
		a.op = "acquire"
	}
	ctx, a.span = lb.startSpan(ctx, "sqllock."+a.op)
	if block {
		tel.waiters.Add(ctx, 1, a.label.attrs())
	}
	return ctx, a
}

// end records the outcome: the granted lease's core and token, or the error.
func (a *acquisition) end(core *Lease, token int64, err error) {
	ctx := context.Background()
	if a.block {
		tel.waiters.Add(ctx, -1, a.label.attrs())
	}
	result := "acquired"
	switch {
	case err == nil:
		core.MarkHeld()
		if a.span.IsRecording() {
			a.span.SetAttributes(attribute.Int64(AttrToken, token))
		}
	case errors.Is(err, sqllock.ErrNotAcquired):
		result = "not_acquired"
	default:
		result = "error"
	}
	attrs := a.label.attrs(AttrOperation, a.op, AttrResult, result)
	tel.acquisitions.Add(ctx, 1, attrs)
	tel.acquireDur.Record(ctx, time.Since(a.start).Seconds(), attrs)
	if a.span.IsRecording() {
		a.span.SetAttributes(attribute.String(AttrResult, result))
	}
	if result == "not_acquired" {
		err = nil // an answer, not a failure
	}
	endSpan(a.span, err)
}

// MarkHeld counts the lease as held from now (the holders gauge, the hold time)
// until it ends. Idempotent: reentrant holds of one lease count once, and so do the
// leases that share a Holds. A lease that is never marked (a fairqueue ticket that was
// not granted) is not counted.
func (l *Lease) MarkHeld() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.heldAt.IsZero() && l.err == nil {
		l.heldAt = time.Now()
		if l.holds.add(1) {
			tel.holders.Add(context.Background(), 1, l.label.attrs())
		}
	}
}

// Holds counts the held leases that are one hold for the holders gauge (Params.Holds).
// The zero value is ready to use.
type Holds struct {
	mu sync.Mutex
	n  int
}

// add counts a lease held (d = 1) or ended (-1) and reports whether the gauge moves:
// for the first lease held and the last one ended. A nil Holds counts each lease by
// itself.
func (h *Holds) add(d int) bool {
	if h == nil {
		return true
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n += d
	return (d > 0 && h.n == 1) || (d < 0 && h.n == 0)
}

// ended records the end of a lease marked held: why is "" for a release, else the
// cause of the loss. Called once, by end.
func (l *Lease) ended(heldAt time.Time, why string) {
	if heldAt.IsZero() {
		return
	}
	ctx := context.Background()
	end := "released"
	if why != "" {
		end = "lost"
		tel.losses.Add(ctx, 1, l.label.attrs(AttrCause, why))
	}
	if l.holds.add(-1) {
		tel.holders.Add(ctx, -1, l.label.attrs())
	}
	tel.holdDur.Record(ctx, time.Since(heldAt).Seconds(), l.label.attrs(AttrEnd, end))
}

// renewal records one keep-alive that started at start.
func (l *Lease) renewal(start time.Time, err error) {
	result := "ok"
	switch {
	case errors.Is(err, ErrGone):
		result = "lost"
	case err != nil:
		result = "error"
	}
	attrs := l.label.attrs(AttrResult, result)
	tel.renewals.Add(context.Background(), 1, attrs)
	tel.renewDur.Record(context.Background(), time.Since(start).Seconds(), attrs)
}

// releaseSpan starts the span of a Release.
func (l *Lease) releaseSpan(ctx context.Context) (context.Context, trace.Span) {
	return l.label.startSpan(ctx, "sqllock.release")
}

// clientSpan is the option of every span of the library, made once.
var clientSpan = trace.WithSpanKind(trace.SpanKindClient)

// startSpan starts a client span of the label's lock; its attributes are built only
// if the span records (an SDK is installed and samples it).
func (lb Label) startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	ctx, span := tel.tracer.Start(ctx, name, clientSpan)
	if span.IsRecording() {
		span.SetAttributes(attribute.String(AttrStrategy, lb.Strategy), attribute.String(AttrDBSystem, dbSystem(lb.Dialect)), lb.nameAttr())
	}
	return ctx, span
}

// endSpan ends span, with an error status if err is not nil.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
