package espipeline.pekko;

import com.typesafe.config.Config;
import com.typesafe.config.ConfigFactory;
import java.sql.Connection;
import java.sql.DriverManager;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.TimeUnit;
import org.apache.pekko.Done;
import org.apache.pekko.actor.typed.ActorRef;
import org.apache.pekko.actor.typed.ActorSystem;
import org.apache.pekko.actor.typed.Behavior;
import org.apache.pekko.actor.typed.ChildFailed;
import org.apache.pekko.actor.typed.Terminated;
import org.apache.pekko.actor.typed.javadsl.AskPattern;
import org.apache.pekko.actor.typed.javadsl.Behaviors;
import org.apache.pekko.persistence.typed.PersistenceId;
import org.apache.pekko.persistence.typed.javadsl.CommandHandler;
import org.apache.pekko.persistence.typed.javadsl.EventHandler;
import org.apache.pekko.persistence.typed.javadsl.EventSourcedBehavior;

/**
 * A Pekko Persistence application as one would write it: a typed event-sourced "cart" whose events Jackson
 * serializes to JSON, journaled by pekko-persistence-jdbc's jdbc-journal on PostgreSQL (application.conf).
 *
 * <pre>
 * write --jdbc-url jdbc:postgresql://HOST:PORT/DB --user U --worker W --entities N --events E [--pause-ms P]
 *     N carts (persistence ids cart|W-0 .. cart|W-(N-1)) persist E events each, all carts at once (the
 *     commands of round e, one per cart, sent P ms after those of round e-1); prints "written COUNT".
 * read  --jdbc-url ... --user U --worker W --entities N
 *     recovers the same N carts from the journal (Pekko's own replay) and prints "replayed COUNT",
 *     the events they replayed.
 * </pre>
 *
 * <p>No password is taken: the PostgreSQL JDBC driver reads it from the libpq passfile that PGPASSFILE names.
 */
public final class Writer {

  /** The marker that binds a class to Jackson JSON (pekko.actor.serialization-bindings). */
  public interface JsonSerializable {}

  /** The cart's one event: stored as {"sku": ..., "qty": ...} with the class name as its manifest. */
  public record ItemAdded(String sku, int qty) implements JsonSerializable {}

  public interface Command {}

  public record AddItem(String sku, int qty, ActorRef<Done> replyTo) implements Command {}

  public record GetState(ActorRef<State> replyTo) implements Command {}

  /** What a cart knows: the events it has applied and their quantities. Never stored (no snapshots). */
  public record State(long events, long quantity) {
    State apply(ItemAdded e) {
      return new State(events + 1, quantity + e.qty());
    }
  }

  public static final class Cart extends EventSourcedBehavior<Command, ItemAdded, State> {
    public Cart(String id) {
      super(PersistenceId.of("cart", id));
    }

    @Override
    public State emptyState() {
      return new State(0, 0);
    }

    @Override
    public CommandHandler<Command, ItemAdded, State> commandHandler() {
      return newCommandHandlerBuilder()
          .forAnyState()
          .onCommand(AddItem.class, (state, c) ->
              Effect().persist(new ItemAdded(c.sku(), c.qty())).thenReply(c.replyTo(), s -> Done.getInstance()))
          .onCommand(GetState.class, (state, c) -> Effect().reply(c.replyTo(), state))
          .build();
    }

    @Override
    public EventHandler<State, ItemAdded> eventHandler() {
      return newEventHandlerBuilder().forAnyState().onEvent(ItemAdded.class, State::apply).build();
    }
  }

  /** The guardian's one message: start the cart `id` and watch it. */
  public record Spawn(String id, ActorRef<ActorRef<Command>> replyTo) {}

  /** Spawns the carts and watches them: the first that fails (recovery or a write) completes `failed`. */
  static Behavior<Spawn> guardian(CompletableFuture<Throwable> failed) {
    return Behaviors.setup(ctx -> Behaviors.receive(Spawn.class)
        .onMessage(Spawn.class, s -> {
          ActorRef<Command> cart = ctx.spawn(new Cart(s.id()), "cart-" + s.id());
          ctx.watch(cart);
          s.replyTo().tell(cart);
          return Behaviors.same();
        })
        .onSignal(ChildFailed.class, f -> {
          failed.complete(f.getCause());
          return Behaviors.same();
        })
        .onSignal(Terminated.class, t -> {
          failed.complete(new IllegalStateException(t.getRef().path().name() + " stopped"));
          return Behaviors.same();
        })
        .build());
  }

  private static final Duration ASK = Duration.ofSeconds(120);

  public static void main(String[] args) {
    int code;
    try {
      code = run(args);
    } catch (Throwable t) {
      t.printStackTrace(System.err);
      StringBuilder causes = new StringBuilder();
      for (Throwable c = t; c != null; c = c.getCause() == c ? null : c.getCause()) {
        causes.append(causes.length() == 0 ? "" : " <- ").append(String.valueOf(c).replaceAll("\\s+", " "));
      }
      System.err.println("pekko writer failed: " + causes);  // last, so that a caller's tail shows it
      code = 1;
    }
    System.out.flush();
    System.exit(code);
  }

  private static int run(String[] args) throws Exception {
    if (args.length < 1 || !(args[0].equals("write") || args[0].equals("read"))) {
      System.err.println("usage: write|read --jdbc-url URL --user U --worker W --entities N [--events E] [--pause-ms P]");
      return 2;
    }
    String mode = args[0];
    Map<String, String> opts = new HashMap<>();
    for (int i = 1; i + 1 < args.length; i += 2) {
      opts.put(args[i], args[i + 1]);
    }
    String worker = required(opts, "--worker");
    int entities = Integer.parseInt(required(opts, "--entities"));
    int events = Integer.parseInt(opts.getOrDefault("--events", "0"));
    int pauseMs = Integer.parseInt(opts.getOrDefault("--pause-ms", "0"));
    String url = required(opts, "--jdbc-url");
    String user = required(opts, "--user");
    // One plain connection first: a wrong database, user or passfile fails here at once, with the driver's own
    // message, rather than as the journal's circuit breaker timing out.
    Properties login = new Properties();
    login.setProperty("user", user);
    try (Connection c = DriverManager.getConnection(url, login)) {
      c.createStatement().execute("SELECT 1");
    }
    Map<String, Object> db = new HashMap<>();
    db.put("jdbc-journal.slick.db.url", url);
    db.put("jdbc-journal.slick.db.user", user);
    Config config = ConfigFactory.parseMap(db).withFallback(ConfigFactory.load());

    CompletableFuture<Throwable> failed = new CompletableFuture<>();
    ActorSystem<Spawn> system = ActorSystem.create(guardian(failed), "cart-" + worker, config);
    try {
      List<ActorRef<Command>> carts = new ArrayList<>();
      for (int i = 0; i < entities; i++) {
        String id = worker + "-" + i;
        CompletionStage<ActorRef<Command>> spawned = AskPattern.ask(system, r -> new Spawn(id, r), ASK,
            system.scheduler());
        carts.add(spawned.toCompletableFuture().get(ASK.toSeconds(), TimeUnit.SECONDS));
      }
      if (mode.equals("write")) {
        // No command waits for another's reply: each cart persists its events one by one (stashing the rest),
        // all carts at the same time, so the journal's batches and connections interleave.
        List<CompletableFuture<Done>> acks = new ArrayList<>();
        for (int e = 1; e <= events; e++) {
          for (ActorRef<Command> cart : carts) {
            int qty = e;
            acks.add(AskPattern.<Command, Done>ask(cart, r -> new AddItem("sku-" + (qty % 7), qty, r), ASK,
                system.scheduler()).toCompletableFuture());
          }
          if (pauseMs > 0 && e < events) {
            Thread.sleep(pauseMs);
          }
        }
        CompletableFuture<Void> all = CompletableFuture.allOf(acks.toArray(new CompletableFuture[0]));
        CompletableFuture.anyOf(all, failed).get(ASK.toSeconds(), TimeUnit.SECONDS);
        if (!all.isDone()) {
          throw new IllegalStateException("a cart failed", failed.getNow(null));
        }
        all.get();
        System.out.println("written " + acks.size());
      } else {
        long replayed = 0;
        for (ActorRef<Command> cart : carts) {
          CompletableFuture<State> state = AskPattern.<Command, State>ask(cart, GetState::new, ASK,
              system.scheduler()).toCompletableFuture();
          CompletableFuture.anyOf(state, failed).get(ASK.toSeconds(), TimeUnit.SECONDS);
          if (!state.isDone()) {
            throw new IllegalStateException("a cart failed to recover", failed.getNow(null));
          }
          replayed += state.get().events();
        }
        System.out.println("replayed " + replayed);
      }
      return 0;
    } finally {
      system.terminate();
      system.getWhenTerminated().toCompletableFuture().get(30, TimeUnit.SECONDS);
    }
  }

  private static String required(Map<String, String> opts, String name) {
    String v = opts.get(name);
    if (v == null) {
      throw new IllegalArgumentException("missing " + name);
    }
    return v;
  }
}
