// usage: node append.mjs <connectionString> <workerId> <streams> <eventsPerStream> [eventsPerAppend] [shape]
// shape: "v2" (default: ItemAdded {sku, qty, unit_price}) or "v1" (the older {sku, qty, price}, and every
// fourth event an ItemRemoved {sku}): a history whose payloads changed shape, for the upcasters.
import { getPostgreSQLEventStore } from '@event-driven-io/emmett-postgresql';

const [conn, workerId, streamsArg, perStreamArg, perAppendArg, shapeArg] = process.argv.slice(2);
const shape = shapeArg ?? 'v2';
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
        if (shape === 'v1' && k % 4 === 3) batch.push({ type: 'ItemRemoved', data: { sku: `sku-${(k - 1) % 7}` } });
        else if (shape === 'v1') batch.push({ type: 'ItemAdded', data: { sku: `sku-${k % 7}`, qty: k, price: 1 + (k % 5) } });
        else batch.push({ type: 'ItemAdded', data: { sku: `sku-${k % 7}`, qty: k, unit_price: 1.5 } });
      // sequential appends per stream; each appendToStream is its own transaction
      await store.appendToStream(streamName, batch);
      total += batch.length;
    }
  }
} finally {
  await store.close(); // ends the pg pool; without it node keeps running
}
console.log(JSON.stringify({ worker: isNaN(Number(workerId)) ? workerId : Number(workerId), events: total }));
