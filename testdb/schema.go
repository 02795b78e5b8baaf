package testdb

import (
	"database/sql"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
)

// openInSchema opens dsn with schema as the search_path (PostgreSQL) or the current
// database (MySQL).
func openInSchema(d sqllock.Dialect, dsn, schema string) (*sql.DB, error) {
	if d == sqllock.Postgres {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			return nil, err
		}
		cfg.RuntimeParams["search_path"] = schema
		return stdlib.OpenDB(*cfg), nil
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, err
	}
	cfg.DBName = schema
	return sql.Open("mysql", cfg.FormatDSN())
}
