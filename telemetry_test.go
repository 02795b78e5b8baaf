package sqllock_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// The global providers can be installed once per process: instruments created before
// take the first one.
var (
	telOnce   sync.Once
	telReader *sdkmetric.ManualReader
	telSpans  *tracetest.SpanRecorder
)

func installTelemetry() {
	telOnce.Do(func() {
		telReader = sdkmetric.NewManualReader()
		otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(telReader)))
		telSpans = tracetest.NewSpanRecorder()
		otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telSpans)))
	})
}

// telPoint is a data point of the in-memory reader: a metric's unit, its attributes,
// and its value (sums) or count (histograms).
type telPoint struct {
	unit  string
	attrs attribute.Set
	value float64
}

func collect(t *testing.T) map[string][]telPoint {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := telReader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string][]telPoint{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != "github.com/sqllock/sqllock" {
			continue
		}
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range data.DataPoints {
					out[m.Name] = append(out[m.Name], telPoint{m.Unit, p.Attributes, float64(p.Value)})
				}
			case metricdata.Histogram[float64]:
				for _, p := range data.DataPoints {
					out[m.Name] = append(out[m.Name], telPoint{m.Unit, p.Attributes, float64(p.Count)})
				}
			}
		}
	}
	return out
}

// total sums the points of metric whose attributes include every one of want.
func total(points map[string][]telPoint, metric string, want ...attribute.KeyValue) float64 {
	var n float64
	for _, p := range points[metric] {
		match := true
		for _, kv := range want {
			if v, ok := p.attrs.Value(kv.Key); !ok || v != kv.Value {
				match = false
			}
		}
		if match {
			n += p.value
		}
	}
	return n
}

// TestTelemetry installs an in-memory OpenTelemetry metric reader and span recorder
// and checks, per strategy and database, the metrics of one acquisition, one
// refused TryAcquire, one Acquire that waited until its context was cancelled, one
// lease lost to a partition and one released: their names, units and counts; the
// holders gauge sampled at 1 while a lease is held (and still 1 while a waiter
// blocks), at 0 once it was lost; the waiters gauge at 1 while the Acquire blocks
// and 0 after; the loss counted with the cause "deadline" (a partitioned holder
// hears nothing: its local deadline ends the lease); both gauges back where they
// started. With WithOwner (every strategy but forupdate, which rejects it), two
// reentrant holds of one lease count once: holders stays at 1 with both held and
// after one was released, and is 0 after both. The spans carry a hash of the name
// (sqllock.name.sha256: the first 8 bytes of its SHA-256, in hex), never the name;
// the acquisition spans carry their result and, when granted, the lease's token;
// there is one release span per Release (a release span inside a refused
// acquisition's own span, fairqueue giving back its ticket, is set aside).
func TestTelemetry(t *testing.T) {
	installTelemetry()
	wantUnits := map[string]string{
		"sqllock.acquisitions": "{acquisition}", "sqllock.acquire.duration": "s", "sqllock.hold.duration": "s",
		"sqllock.losses": "{loss}", "sqllock.holders": "{lease}", "sqllock.waiters": "{call}",
		"sqllock.renewals": "{renewal}", "sqllock.renewal.duration": "s",
	}
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, s := range strategies {
			t.Run(s.name, func(t *testing.T) {
				const ttl, ka = 2 * time.Second, 500 * time.Millisecond
				ctx := testdb.Context(t, 2*time.Minute)
				pdb, proxy := testdb.OpenProxied(t, d)
				a := s.timed(t, pdb, d, ttl, ka)
				b := s.timed(t, testdb.Open(t, d), d, ttl, ka)
				name := testdb.Name(t, "secret-customer-42")
				strat := attribute.String("sqllock.strategy", s.name)
				dbSystem := attribute.String("db.system.name", map[sqllock.Dialect]string{
					sqllock.Postgres: "postgresql", sqllock.MySQL: "mysql"}[d])
				// gauge is the value of an up-down counter of this strategy and
				// database now, less its value in base.
				gauge := func(base map[string][]telPoint, metric string) float64 {
					return total(collect(t), metric, strat, dbSystem) - total(base, metric, strat, dbSystem)
				}
				wantGauge := func(base map[string][]telPoint, metric string, want float64, when string) {
					t.Helper()
					if got := gauge(base, metric); got != want {
						t.Errorf("%s %s: %v, want %v", metric, when, got, want)
					}
				}

				if s.name != "forupdate" {
					rname := testdb.Name(t, "reentrant")
					owner := sqllock.WithOwner("telemetry-owner")
					base := collect(t)
					r1, err := a.Acquire(ctx, rname, owner)
					if err != nil {
						t.Fatal(err)
					}
					wantGauge(base, "sqllock.holders", 1, "while one hold is held")
					r2, err := a.Acquire(ctx, rname, owner)
					if err != nil {
						t.Fatalf("reentrant Acquire: %v", err)
					}
					if r2.Token() != r1.Token() {
						t.Errorf("reentrant hold's token %d, want the first hold's %d", r2.Token(), r1.Token())
					}
					wantGauge(base, "sqllock.holders", 1, "while two reentrant holds of one lease are held (they count once)")
					must(t, r2.Release(ctx))
					wantGauge(base, "sqllock.holders", 1, "after one of two reentrant holds was released (the lease is still held)")
					must(t, r1.Release(ctx))
					wantGauge(base, "sqllock.holders", 0, "after both reentrant holds were released")
				}

				before := collect(t)
				la, err := a.Acquire(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				wantGauge(before, "sqllock.holders", 1, "while a lease is held")
				if _, err := b.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
					t.Fatalf("TryAcquire of a held lock: %v", err)
				}
				// A waiter blocks until its context is cancelled.
				wctx, wcancel := context.WithCancel(ctx)
				waited := make(chan error, 1)
				go func() {
					l, err := b.Acquire(wctx, name)
					if err == nil {
						l.Release(ctx)
					}
					waited <- err
				}()
				// Nothing but the gauge tells that the Acquire has begun waiting: poll it.
				for deadline := time.Now().Add(10 * time.Second); gauge(before, "sqllock.waiters") == 0; {
					if time.Now().After(deadline) {
						wcancel()
						<-waited
						t.Fatal("sqllock.waiters did not move in 10 s while an Acquire was blocked")
					}
					time.Sleep(10 * time.Millisecond) // polling the gauge
				}
				wantGauge(before, "sqllock.waiters", 1, "while one Acquire is blocked")
				wantGauge(before, "sqllock.holders", 1, "while a lease is held and an Acquire waits for it")
				wcancel()
				if err := <-waited; !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
					t.Fatalf("Acquire whose context was cancelled while it waited: %v", err)
				}
				wantGauge(before, "sqllock.waiters", 0, "after the blocked Acquire returned")
				// A keep-alive succeeds every ka: the renewals counter is the signal.
				okRenewals := func(points map[string][]telPoint) float64 {
					return total(points, "sqllock.renewals", strat, attribute.String("sqllock.result", "ok"))
				}
				for deadline := time.Now().Add(4 * ka); okRenewals(collect(t)) == okRenewals(before); {
					if time.Now().After(deadline) {
						t.Fatalf("no successful renewal counted within %v (keep-alive every %v)", 4*ka, ka)
					}
					time.Sleep(10 * time.Millisecond) // polling the counter
				}
				proxy.Partition()
				select {
				case <-la.Done():
				case <-time.After(2 * ttl):
					t.Fatal("the partitioned lease was not lost within twice its TTL")
				}
				wantGauge(before, "sqllock.holders", 0, "once the lease was lost")
				proxy.Heal()
				if err := la.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
					t.Fatalf("Release of the lost lease: %v", err)
				}
				lb, err := b.Acquire(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				wantGauge(before, "sqllock.holders", 1, "while the next lease is held")
				if err := lb.Release(ctx); err != nil {
					t.Fatal(err)
				}

				after := collect(t)
				for metric, unit := range wantUnits {
					for _, p := range after[metric] {
						if p.unit != unit {
							t.Errorf("%s: unit %q, want %q", metric, p.unit, unit)
						}
					}
				}
				delta := func(metric string, want ...attribute.KeyValue) float64 {
					want = append(want, strat, dbSystem)
					return total(after, metric, want...) - total(before, metric, want...)
				}
				result := func(r string) attribute.KeyValue { return attribute.String("sqllock.result", r) }
				cause := func(c string) attribute.KeyValue { return attribute.String("sqllock.loss.cause", c) }
				for _, c := range []struct {
					what string
					got  float64
					want float64
				}{
					{"acquisitions acquired", delta("sqllock.acquisitions", result("acquired")), 2},
					{"acquisitions not acquired", delta("sqllock.acquisitions", result("not_acquired")), 2},
					{"acquisitions failed", delta("sqllock.acquisitions", result("error")), 0},
					{"try_acquire calls", delta("sqllock.acquisitions", attribute.String("sqllock.operation", "try_acquire")), 1},
					{"acquire durations", delta("sqllock.acquire.duration"), 4},
					{"losses", delta("sqllock.losses"), 1},
					{"losses by cause deadline", delta("sqllock.losses", cause("deadline")), 1},
					{"holds ended lost", delta("sqllock.hold.duration", attribute.String("sqllock.end", "lost")), 1},
					{"holds ended released", delta("sqllock.hold.duration", attribute.String("sqllock.end", "released")), 1},
					{"holders now", delta("sqllock.holders"), 0},
					{"waiters now", delta("sqllock.waiters"), 0},
				} {
					if c.got != c.want {
						t.Errorf("%s: %v, want %v", c.what, c.got, c.want)
					}
				}
				if n := delta("sqllock.renewal.duration"); n != delta("sqllock.renewals") {
					t.Errorf("renewal durations: %v, renewals %v", n, delta("sqllock.renewals"))
				}

				sum := sha256.Sum256([]byte(name))
				hash := hex.EncodeToString(sum[:8])
				spans := map[string]int{}
				// The spans of name (span name, result and token), by span ID. A
				// release span inside an acquisition's span is the give-back of what a
				// refused acquisition drew (fairqueue's ticket): set aside, and allowed
				// only inside a not_acquired one.
				mine := map[trace.SpanID]string{}
				nested := map[trace.SpanID]trace.SpanID{} // release span -> its parent
				for _, sp := range telSpans.Ended() {
					ours, named := false, false
					var res, tok string
					for _, kv := range sp.Attributes() {
						if kv == strat {
							ours = true
						}
						if kv.Value.AsString() == name {
							t.Errorf("span %s carries the lock name", sp.Name())
						}
						switch kv.Key {
						case "sqllock.name.sha256":
							named = kv.Value.AsString() == hash
						case "sqllock.result":
							res = " result=" + kv.Value.Emit()
						case "sqllock.token":
							tok = " token=" + kv.Value.Emit()
						}
					}
					if ours {
						spans[sp.Name()]++
					}
					if ours && named {
						mine[sp.SpanContext().SpanID()] = sp.Name() + res + tok
						if sp.Name() == "sqllock.release" && sp.Parent().IsValid() {
							nested[sp.SpanContext().SpanID()] = sp.Parent().SpanID()
						}
					}
				}
				var got []string
				for id, desc := range mine {
					parent, ok := nested[id]
					if ok && strings.HasPrefix(mine[parent], "sqllock.") {
						if !strings.HasSuffix(mine[parent], "result=not_acquired") {
							t.Errorf("a release span inside the span %q", mine[parent])
						}
						continue
					}
					got = append(got, desc)
				}
				for _, n := range []string{"sqllock.acquire", "sqllock.try_acquire", "sqllock.release"} {
					if spans[n] == 0 {
						t.Errorf("no %s span (spans: %v)", n, spans)
					}
				}
				want := []string{
					fmt.Sprintf("sqllock.acquire result=acquired token=%d", la.Token()),
					"sqllock.try_acquire result=not_acquired",
					"sqllock.acquire result=not_acquired",
					fmt.Sprintf("sqllock.acquire result=acquired token=%d", lb.Token()),
					"sqllock.release",
					"sqllock.release",
				}
				slices.Sort(got)
				slices.Sort(want)
				if !slices.Equal(got, want) {
					t.Errorf("spans with sqllock.name.sha256 = %s (SHA-256 of the name, first 8 bytes):\n got %q\nwant %q", hash, got, want)
				}
			})
		}
	})
}

// TestTelemetryNames: with WithTelemetryNames the spans carry the lock name itself.
func TestTelemetryNames(t *testing.T) {
	installTelemetry()
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		l, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithTelemetryNames())
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		name := testdb.Name(t, "visible")
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
		found := map[string]bool{}
		for _, sp := range telSpans.Ended() {
			for _, kv := range sp.Attributes() {
				if kv == attribute.String("sqllock.name", name) {
					found[sp.Name()] = true
				}
			}
		}
		if !found["sqllock.acquire"] || !found["sqllock.release"] {
			t.Errorf("spans naming the lock: %v, want sqllock.acquire and sqllock.release", found)
		}
	})
}

// TestNoSDKInTheBuild: the README promises that the library brings only the
// OpenTelemetry API into an application's build; the SDK serves its tests alone.
func TestNoSDKInTheBuild(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/sqllock/sqllock/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	api := false
	for _, pkg := range strings.Fields(string(out)) {
		if strings.HasPrefix(pkg, "go.opentelemetry.io/otel/sdk") {
			t.Errorf("the library's packages depend on %s", pkg)
		}
		api = api || pkg == "go.opentelemetry.io/otel/metric"
	}
	if !api {
		t.Error("go list shows no OpenTelemetry API: the check looks at the wrong packages")
	}
}
