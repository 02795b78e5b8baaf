package fairqueue

// TopTicketMySQL is the ticket number of a MySQL name's top row (topMySQL), for the
// tests' reads of the ticket table.
const TopTicketMySQL = topMySQL
