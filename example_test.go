package sqllock_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"log"
	"net/http"
	"os"
	"os/signal"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/uniqueindex"
)

// One active scheduler among the replicas of a service: every replica campaigns, the
// leader runs the scheduler until it loses the lease or the service stops, and a
// health endpoint says who leads. (The example needs a database, so it is compiled
// but not run by go test; TestCampaignFailover runs the same calls.)
func ExampleCampaign() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL")) // migrated with migrations.Up
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	locker, err := uniqueindex.New(db, sqllock.Postgres, uniqueindex.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	http.HandleFunc("/leader", func(w http.ResponseWriter, r *http.Request) {
		h, err := sqllock.Leader(r.Context(), locker, "scheduler")
		if errors.Is(err, sqllock.ErrNoHolder) {
			http.Error(w, "no leader (election in progress)", http.StatusServiceUnavailable)
			return
		} else if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		json.NewEncoder(w).Encode(h) // host, pid, token, since, remaining
	})

	err = sqllock.Campaign(ctx, locker, "scheduler", func(ctx context.Context) error {
		lease, _ := sqllock.LeaseFromContext(ctx)
		log.Printf("leading with token %d", lease.Token())
		ticker := time.NewTicker(time.Minute)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done(): // lost the lease (context.Cause matches ErrLost) or shutting down
				return nil
			case <-ticker.C:
				// ... schedule the due jobs, fencing their writes with lease.Token() ...
			}
		}
	})
	if !errors.Is(err, context.Canceled) {
		log.Fatal(err) // a permanent error, or an error fn returned
	}
}
