// usage: node append.mjs <connectionString> <workerId> <streams> <eventsPerStream> [eventsPerAppend]
import { getPostgreSQLEventStore } from '@event-driven-io/emmett-postgresql';

const [conn, workerId, streamsArg, perStreamArg, perAppendArg] = process.argv.slice(2);
if (!conn || workerId === undefined || !streamsArg || !perStreamArg) {
  console.error('usage: node append.mjs <connectionString> <workerId> <streams> <eventsPerStream> [eventsPerAppend]');
  process.exit(2);
}
const streams = parseInt(streamsArg, 10);
const perStream = parseInt(perStreamArg, 10);
const perAppend = Math.max(1, parseInt(perAppendArg ?? '1', 10));

const store = getPostgreSQLEventStore(conn);
let total = 0;
try {
  for (let s = 0; s < streams; s++) {
    const streamName = `cart-${workerId}-${s}`; // stream type = 'cart' (text before the first '-')
    for (let n = 0; n < perStream; n += perAppend) {
      const batch = [];
      for (let k = n; k < Math.min(n + perAppend, perStream); k++)
        batch.push({ type: 'ItemAdded', data: { sku: `sku-${k % 7}`, qty: k, unit_price: 1.5 } });
      // sequential appends per stream; each appendToStream is its own transaction
      await store.appendToStream(streamName, batch);
      total += batch.length;
    }
  }
} finally {
  await store.close(); // ends the pg pool; without it node keeps running
}
console.log(JSON.stringify({ worker: isNaN(Number(workerId)) ? workerId : Number(workerId), events: total }));
