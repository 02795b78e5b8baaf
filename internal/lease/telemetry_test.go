package lease

import (
	"context"
	"errors"
	"testing"

	"go.opentelemetry.io/otel"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// TestTelemetryOnlyWhenInstalled: until the application installs providers, no span
// is started (the caller's context comes back as it is, nothing is allocated) and
// nothing is measured; once it installs any (here the API's no-op ones), spans start.
// The test installs global providers: it is the only one of the package to do so.
func TestTelemetryOnlyWhenInstalled(t *testing.T) {
	if tracing() || metering() {
		t.Fatalf("installed before any provider was: tracing %v, metering %v", tracing(), metering())
	}
	ctx := context.Background()
	got, span := label.startSpan(ctx, "sqllock.test")
	span.End()
	if got != ctx {
		t.Fatal("a span was started with no TracerProvider installed")
	}
	life := func(observed bool) func() {
		return func() {
			if observed {
				_, span := label.startSpan(ctx, "sqllock.test")
				defer span.End()
			}
			le := Prepare(&keeper{}, Params{Label: label})
			if observed {
				le.MarkHeld()
			}
			le.end(errGoneForTest, "")
		}
	}
	if bare, observed := testing.AllocsPerRun(100, life(false)), testing.AllocsPerRun(100, life(true)); observed != bare {
		t.Errorf("a span and a held lease's measurements with no provider installed: %v allocations, %v without them", observed, bare)
	}

	otel.SetTracerProvider(tracenoop.NewTracerProvider())
	otel.SetMeterProvider(metricnoop.NewMeterProvider())
	if !tracing() || !metering() {
		t.Fatalf("not installed after SetTracerProvider and SetMeterProvider: tracing %v, metering %v", tracing(), metering())
	}
	got, span = label.startSpan(ctx, "sqllock.test")
	span.End()
	if got == ctx {
		t.Fatal("no span started with a TracerProvider installed")
	}
}

var errGoneForTest = errors.New("test")
