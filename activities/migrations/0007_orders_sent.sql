-- How often an allocation's current order (its placement, then its stop) has been handed to the
-- scheduler loop to signal, and when last. Orders not yet acted on are sent again, less and less
-- often: a stop is acted on only when its attempt ends, and sent every cycle over a whole grace
-- it spent a job workflow's signal and history limits on copies.
ALTER TABLE allocations ADD COLUMN orders_sent integer NOT NULL DEFAULT 0;
ALTER TABLE allocations ADD COLUMN order_sent_at double precision;
