//go:build ha

// Package ha_test proves what the library promises beyond one server: on a Galera
// cluster, across a PostgreSQL failover and behind pgbouncer, in the HA lab of
// testdb/ha (build tag ha; `go test -tags ha ./ha/`).
package ha_test

import (
	"os"
	"testing"

	"github.com/sqllock/sqllock/testdb/ha"
)

func TestMain(m *testing.M) { os.Exit(ha.Main(m)) }
