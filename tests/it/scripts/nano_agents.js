// Session agents on a CouchDB-style store written with nano, the Node CouchDB client, as its
// users write them: `db.get` the session, append a message, `db.insert(doc)` it back (a
// `POST /{db}` naming the document by its `_id`, with the `_rev` read). On a 409 each agent does
// what such code commonly does: take the latest `_rev` and insert its copy again (up to 5
// times). Agents are spread over the endpoints given. Prints one JSON line: the ids of the
// writes nano resolved, the errors it threw (other than the 409s retried), the 409s met, the
// first answer body, and the document the store holds at the end.
//
// With MODE `bulk`, each write is a `db.bulk({docs: [doc]})` (a `POST /{db}/_bulk_docs`), its
// entry's `conflict` error taken as the 409.
//
// usage: node nano_agents.js ENDPOINTS DB DOC AGENTS WRITES STORE [MODE]
'use strict';
const nano = require('nano');

const [endpoints, dbName, docId, agents, writes, store] = [
  process.argv[2].split(','), process.argv[3], process.argv[4],
  Number(process.argv[5]), Number(process.argv[6]), process.argv[7],
];
const bulk = process.argv[8] === 'bulk';

// One write of `doc`: nano's answer, or its error (a bulk entry's error as a 409).
async function write(db, doc) {
  if (!bulk) return db.insert(doc);
  const [entry] = await db.bulk({ docs: [doc] });
  if (entry && entry.error) {
    const e = new Error(`${entry.error}: ${entry.reason}`);
    e.statusCode = entry.error === 'conflict' ? 409 : 0;
    throw e;
  }
  return entry;
}

const acked = [];
const errors = [];
const answers = [];
let conflicts = 0;

const pause = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function agent(i) {
  const db = nano(endpoints[i % endpoints.length]).use(dbName);
  for (let k = 0; k < writes; k++) {
    const id = `a${i}-${k}`;
    let doc;
    try {
      doc = await db.get(docId);
    } catch (e) {
      if (e.statusCode !== 404) {
        errors.push({ id, status: e.statusCode || 0, error: String(e.message) });
        continue;
      }
      doc = { _id: docId, messages: [] };
    }
    doc.messages = doc.messages || [];
    doc.messages.push({ id, role: 'user', content: `agent ${i} write ${k}` });
    await pause(Math.random() * 4);
    for (let attempt = 0; attempt < 6; attempt++) {
      try {
        const answer = await write(db, doc);
        answers.push(answer);
        acked.push(id);
        break;
      } catch (e) {
        if (e.statusCode === 409 && attempt < 5) {
          conflicts++;
          const latest = await db.get(docId).catch(() => null);
          if (latest) doc._rev = latest._rev; // my copy again, with the latest _rev
          continue;
        }
        errors.push({ id, status: e.statusCode || 0, error: String(e.message) });
        break;
      }
    }
  }
}

(async () => {
  await Promise.all(Array.from({ length: agents }, (_, i) => agent(i)));
  const final = await nano(store).use(dbName).get(docId).catch((e) => ({ error: String(e.message) }));
  console.log(JSON.stringify({ acked, errors, conflicts, answers: answers.slice(0, 1), final }));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
