// Command prometheus shows sqllock's OpenTelemetry metrics on a Prometheus /metrics
// endpoint: it installs the OpenTelemetry SDK with the Prometheus exporter (the
// library itself uses only the OpenTelemetry API), then runs three simulated
// replicas, each with its own pool and Locker, taking turns at one job lock.
//
//	cd examples/prometheus
//	go run . -dsn 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable' -listen 127.0.0.1:9464
//	curl -s 127.0.0.1:9464/metrics | grep '^sqllock_'
//
// With -once it prints the sqllock lines of /metrics after a few seconds and exits
// (what the README shows). The database must be migrated (sqllock migrate up, or
// migrations.Up); -dsn defaults to $SQLLOCK_DSN.
package main

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/uniqueindex"
)

func main() {
	dsn := flag.String("dsn", os.Getenv("SQLLOCK_DSN"), "database DSN (default $SQLLOCK_DSN)")
	listen := flag.String("listen", "127.0.0.1:9464", "address of the /metrics endpoint")
	once := flag.Bool("once", false, "print the sqllock metrics after -for and exit")
	runFor := flag.Duration("for", 5*time.Second, "with -once: how long the replicas run")
	flag.Parse()
	if *dsn == "" {
		log.Fatal("give -dsn or SQLLOCK_DSN")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *dsn, *listen, *once, *runFor); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func run(ctx context.Context, dsn, listen string, once bool, runFor time.Duration) error {
	// The application's side: the SDK and an exporter, installed globally.
	exporter, err := otelprom.New()
	if err != nil {
		return err
	}
	otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter)))
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: promhttp.Handler()}
	go srv.Serve(ln)
	defer srv.Close()

	if once {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, runFor)
		defer cancel()
	}
	driver := "mysql"
	if strings.HasPrefix(dsn, "postgres") || strings.Contains(dsn, "host=") {
		driver = "pgx"
	}
	var wg sync.WaitGroup
	for i := range 3 { // three replicas: a pool and a Locker each
		db, err := sql.Open(driver, dsn)
		if err != nil {
			return err
		}
		defer db.Close()
		d, err := sqllock.DetectDialect(ctx, db)
		if err != nil {
			return err
		}
		l, err := uniqueindex.New(db, d)
		if err != nil {
			return err
		}
		defer l.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				err := sqllock.Do(ctx, l, "nightly-report", func(ctx context.Context) error {
					select { // the job
					case <-time.After(20 * time.Millisecond):
					case <-ctx.Done():
					}
					return nil
				})
				if err != nil && ctx.Err() == nil {
					log.Printf("replica %d: %v", i, err)
				}
			}
		}()
	}
	wg.Wait()
	if !once {
		<-ctx.Done()
		return ctx.Err()
	}
	resp, err := http.Get("http://" + ln.Addr().String() + "/metrics")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "sqllock_") && !strings.Contains(line, "_bucket{") {
			fmt.Println(line)
		}
	}
	return sc.Err()
}
