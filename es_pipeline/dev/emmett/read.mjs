// usage: node read.mjs <connectionString> <streamName>
import { getPostgreSQLEventStore } from '@event-driven-io/emmett-postgresql';

const [conn, stream] = process.argv.slice(2);
if (!conn || !stream) {
  console.error('usage: node read.mjs <connectionString> <streamName>');
  process.exit(2);
}
const store = getPostgreSQLEventStore(conn);
try {
  const res = await store.readStream(stream);
  const last = res.events.at(-1);
  console.log(JSON.stringify({
    stream,
    count: res.events.length,
    exists: res.streamExists,
    version: res.currentStreamVersion.toString(),
    lastGlobalPosition: last ? last.metadata.globalPosition.toString() : null,
    lastData: last ? last.data : null,
  }));
} finally {
  await store.close();
}
