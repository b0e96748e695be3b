"""
The gym's domains as plain data: value pools, name generators, the seven databases' table specs and the words that
distractor tables are made of. data/gym/prepare.py turns them into SQLite files and questions.

    python -c "from data.gym.domains import DOMAINS; print(list(DOMAINS))"
"""
import re

# -----------------------------------------------------------------------------
# value pools (no apostrophes anywhere, so a value is quoted the same way in the question and in the SQL)

PLACES = ["Fresno", "Oakland", "Bakersfield", "Riverside", "Modesto", "Stockton", "Irvine", "Pasadena", "Salinas",
          "Redding", "Visalia", "Merced", "Chico", "Eureka", "Napa", "Ventura", "Burbank", "Fremont", "Hayward",
          "Lodi", "Tracy", "Davis", "Ukiah", "Yuba", "Madera", "Hanford", "Delano", "Turlock", "Vista", "Tulare"]
FIRST = ["Ana", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Luis", "Mei",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yara", "Zoe", "Leo"]
LAST = ["Garcia", "Smith", "Nguyen", "Patel", "Kim", "Lopez", "Chen", "Brown", "Singh", "Diaz", "Rossi", "Novak",
        "Silva", "Khan", "Moreau", "Ito", "Park", "Weber", "Costa", "Haddad", "Olsen", "Reyes", "Sato", "Young"]
ADJ = ["Silver", "Quiet", "Golden", "Hidden", "Bright", "Lost", "Red", "Wild", "Blue", "Iron", "Green", "Last",
       "Swift", "Broken", "Little", "Northern", "Secret", "Crimson", "Frozen", "Gentle"]
NOUN = ["River", "Garden", "Harbor", "Forest", "Lantern", "Mountain", "Voyage", "Letter", "Bridge", "Island",
        "Castle", "Falcon", "Meadow", "Storm", "Mirror", "Orchard", "Compass", "Tower", "Valley", "Echo"]
NAMES = {  # pool name -> rng -> candidate name
    "person": lambda r: f"{r.choice(FIRST)} {r.choice(LAST)}",
    "school": lambda r: f"{r.choice(PLACES)} {r.choice(['High', 'Middle', 'Elementary', 'Academy', 'Prep'])}",
    "district": lambda r: f"{r.choice(PLACES)} Unified",
    "product": lambda r: f"{r.choice(ADJ)} {r.choice(['Lamp', 'Chair', 'Mug', 'Kettle', 'Desk', 'Rug', 'Clock'])}",
    "airline": lambda r: f"{r.choice(ADJ)} {r.choice(['Air', 'Airways', 'Jet'])}",
    "airport": lambda r: f"{r.choice(PLACES)} {r.choice(['International', 'Regional', 'Municipal'])}",
    "book": lambda r: f"The {r.choice(ADJ)} {r.choice(NOUN)}",
    "hotel": lambda r: f"{r.choice(PLACES)} {r.choice(['Inn', 'Suites', 'Lodge', 'Grand', 'Resort'])}",
    "team": lambda r: f"{r.choice(PLACES)} {r.choice(['Hawks', 'Bears', 'Comets', 'Tigers', 'Rovers'])}",
    "flight": lambda r: f"{r.choice(['GA', 'SW', 'PX', 'QR'])}{r.randint(100, 999)}",
    "phone": lambda r: f"({r.randint(200, 999)}) {r.randint(200, 999)}-{r.randint(1000, 9999)}",
    "isbn": lambda r: f"978-{r.randint(0, 9)}-{r.randint(1000, 9999)}-{r.randint(1000, 9999)}-{r.randint(0, 9)}",
}

# -----------------------------------------------------------------------------
# domains: tables of columns. kinds: pk, name (unique text), cat (list), code (code -> meaning, explained by
# evidence), int/real (lo, hi), date (year range, stored as 'YYYY-MM-DD' TEXT), fk (parent table), text (pool)


def C(name, kind, arg=None, null=0.0, phrase=None, rel=None):
    # phrase: how questions name the column; rel: filter clause with {v}, default "with <phrase> <value>"
    phrase = phrase or re.sub(r"\s*\(.*?\)", "", name).lower()
    return dict(name=name, kind=kind, arg=arg, null=null, phrase=phrase, rel=rel)


def T(name, ent, ents, rows, cols):
    return dict(name=name, ent=ent, ents=ents, rows=rows, cols=cols)


CITY = C("City", "cat", PLACES[:12], rel="in the city {v}")
DOMAINS = {
    "schools": dict(distractors=36, tables=[
        T("districts", "district", "districts", 20, [
            C("District ID", "pk"), C("District Name", "name", "district"), C("County", "cat", PLACES[12:20]),
            C("Budget (USD)", "int", (200_000, 9_000_000))]),
        T("schools", "school", "schools", 120, [
            C("School ID", "pk"), C("School Name", "name", "school"), C("District ID", "fk", "districts"), CITY,
            C("Charter School (Y/N)", "code", {1: "charter schools", 0: "not charter schools"},
              phrase="charter status"),
            C("Funding Type", "code", {"D": "directly funded", "L": "locally funded", "N": "not funded"}),
            C("Enrollment (K-12)", "int", (40, 3000)), C("Open Date", "date", (1950, 2020)),
            C("Phone", "text", "phone", null=0.3)]),
        T("teachers", "teacher", "teachers", 260, [
            C("Teacher ID", "pk"), C("Full Name", "name", "person"), C("School ID", "fk", "schools"),
            C("Subject", "cat", ["Math", "English", "Science", "History", "Art", "Music"]),
            C("Years Experience", "int", (0, 40)), C("Salary", "int", (38_000, 120_000), null=0.1)])]),
    "shop": dict(distractors=0, tables=[
        T("customers", "customer", "customers", 90, [
            C("Customer ID", "pk"), C("Customer Name", "name", "person"), CITY,
            C("Segment", "code", {"C": "consumers", "B": "businesses"}), C("Signup Date", "date", (2015, 2023)),
            C("Lifetime Value ($)", "real", (0, 9000))]),
        T("products", "product", "products", 45, [
            C("Product ID", "pk"), C("Product Name", "name", "product"),
            C("Category", "cat", ["Lighting", "Furniture", "Kitchen", "Decor"]), C("Unit Price", "real", (3, 400)),
            C("In Stock", "code", {1: "in stock", 0: "out of stock"}, phrase="stock status")]),
        T("orders", "order", "orders", 220, [
            C("Order ID", "pk"), C("Customer ID", "fk", "customers"), C("Order Date", "date", (2019, 2024)),
            C("Status", "code", {"S": "shipped", "P": "pending", "X": "cancelled"}),
            C("Total ($)", "real", (5, 3000)), C("Ship Mode", "cat", ["Standard", "Express", "Pickup"], null=0.15)]),
        T("order_items", "order item", "order items", 400, [
            C("Item ID", "pk"), C("Order ID", "fk", "orders"), C("Product ID", "fk", "products"),
            C("Quantity", "int", (1, 12)), C("Discount (%)", "int", (0, 30))])]),
    "flights": dict(distractors=32, tables=[
        T("airlines", "airline", "airlines", 18, [
            C("Airline ID", "pk"), C("Airline Name", "name", "airline"),
            C("Country", "cat", ["USA", "Canada", "Mexico", "Japan", "France"]), C("Fleet Size", "int", (5, 400))]),
        T("airports", "airport", "airports", 30, [
            C("Airport ID", "pk"), C("Airport Name", "name", "airport"), CITY,
            C("Elevation (ft)", "int", (0, 6000))]),
        T("flights", "flight", "flights", 200, [
            C("Flight ID", "pk"), C("Flight No", "name", "flight"), C("Airline ID", "fk", "airlines"),
            C("Origin Airport ID", "fk", "airports"), C("Dest City", "cat", PLACES[12:22]),
            C("Departure Date", "date", (2021, 2024)), C("Distance (km)", "int", (150, 4500)),
            C("Delay (min)", "int", (0, 240), null=0.2),
            C("Status", "code", {"O": "on time", "D": "delayed", "C": "cancelled"})]),
        T("tickets", "ticket", "tickets", 300, [
            C("Ticket ID", "pk"), C("Flight ID", "fk", "flights"), C("Passenger", "name", "person"),
            C("Class", "code", {"E": "economy tickets", "B": "business tickets", "F": "first class tickets"}),
            C("Fare ($)", "real", (49, 2500))])]),
    "clinic": dict(distractors=0, tables=[
        T("doctors", "doctor", "doctors", 25, [
            C("Doctor ID", "pk"), C("Doctor Name", "name", "person"),
            C("Specialty", "cat", ["Cardiology", "Pediatrics", "Oncology", "Neurology", "Dermatology"]),
            C("Hire Date", "date", (1995, 2023)), C("Rating", "real", (2, 5))]),
        T("patients", "patient", "patients", 150, [
            C("Patient ID", "pk"), C("Patient Name", "name", "person"), C("Sex", "code", {"F": "female", "M": "male"}),
            C("Birth Date", "date", (1940, 2015)), CITY, C("Weight (kg)", "real", (3, 140)),
            C("Insurance", "code", {"MC": "on Medicare", "PR": "privately insured"}, null=0.25)]),
        T("visits", "visit", "visits", 350, [
            C("Visit ID", "pk"), C("Patient ID", "fk", "patients"), C("Doctor ID", "fk", "doctors"),
            C("Visit Date", "date", (2020, 2024)),
            C("Diagnosis", "cat", ["Flu", "Asthma", "Migraine", "Rash", "Angina"]),
            C("Cost ($)", "real", (40, 1800))])]),
    "library": dict(distractors=0, tables=[
        T("authors", "author", "authors", 40, [
            C("Author ID", "pk"), C("Author Name", "name", "person"),
            C("Nationality", "cat", ["British", "American", "Nigerian", "Indian", "Chilean"]),
            C("Birth Year", "int", (1850, 2000)), C("Gender", "code", {"F": "female authors", "M": "male authors"})]),
        T("books", "book", "books", 150, [
            C("Book ID", "pk"), C("Title", "name", "book"), C("Author ID", "fk", "authors"),
            C("Genre", "cat", ["Mystery", "Fantasy", "History", "Poetry", "Science"]),
            C("Pub Year", "int", (1900, 2023)),
            C("Pages", "int", (80, 900)),
            C("Format", "cat", ["Hardcover", "Paperback", "Ebook"]), C("ISBN-13", "text", "isbn", null=0.2)]),
        T("members", "member", "members", 80, [
            C("Member ID", "pk"), C("Member Name", "name", "person"),
            C("Membership Type", "code", {"S": "student members", "A": "adult members", "R": "retired members"}),
            C("Join Date", "date", (2010, 2024)), C("Fines Owed ($)", "real", (0, 60)),
            C("Branch", "cat", ["Central", "Eastside", "Harbor", "Hillcrest"])]),
        T("loans", "loan", "loans", 300, [
            C("Loan ID", "pk"), C("Book ID", "fk", "books"), C("Member ID", "fk", "members"),
            C("Loan Date", "date", (2022, 2024)), C("Return Date", "date", (2022, 2024), null=0.3)])]),
    "hotel": dict(distractors=34, tables=[
        T("hotels", "hotel", "hotels", 25, [
            C("Hotel ID", "pk"), C("Hotel Name", "name", "hotel"), CITY, C("Star Rating", "int", (1, 5)),
            C("Chain", "cat", ["Marlow", "Vista Group", "Independent"]),
            C("Opened", "date", (1960, 2022))]),
        T("rooms", "room", "rooms", 150, [
            C("Room ID", "pk"), C("Hotel ID", "fk", "hotels"),
            C("Room Type", "code", {"S": "single rooms", "D": "double rooms", "X": "suites"}),
            C("Nightly Rate ($)", "real", (60, 900)), C("Floor", "int", (1, 20), null=0.2)]),
        T("guests", "guest", "guests", 120, [
            C("Guest ID", "pk"), C("Guest Name", "name", "person"),
            C("Country", "cat", ["USA", "Germany", "Brazil", "Japan", "Kenya"]),
            C("Loyalty Tier", "code", {"G": "gold members", "S": "silver members", "B": "basic members"}),
            C("Phone", "text", "phone", null=0.3)]),
        T("bookings", "booking", "bookings", 320, [
            C("Booking ID", "pk"), C("Room ID", "fk", "rooms"), C("Guest ID", "fk", "guests"),
            C("Check-in Date", "date", (2022, 2024)), C("Nights", "int", (1, 14)),
            C("Paid (Y/N)", "code", {"Y": "paid", "N": "unpaid"}, phrase="payment status")])]),
    "league": dict(distractors=0, tables=[
        T("teams", "team", "teams", 16, [
            C("Team ID", "pk"), C("Team Name", "name", "team"), CITY, C("Founded", "int", (1880, 2005)),
            C("Division", "cat", ["North", "South", "West"]), C("Budget (M$)", "real", (5, 300))]),
        T("players", "player", "players", 200, [
            C("Player ID", "pk"), C("Player Name", "name", "person"), C("Team ID", "fk", "teams"),
            C("Position", "code", {"G": "goalkeepers", "D": "defenders", "M": "midfielders", "F": "forwards"}),
            C("Height (cm)", "int", (160, 205)), C("Birth Date", "date", (1985, 2006)),
            C("Jersey No", "int", (1, 99), null=0.2), C("Foot", "cat", ["Right", "Left", "Both"])]),
        T("games", "game", "games", 120, [
            C("Game ID", "pk"), C("Team ID", "fk", "teams"), C("Game Date", "date", (2022, 2024)),
            C("Venue", "code", {"H": "home games", "A": "away games"}), C("Goals For", "int", (0, 6)),
            C("Attendance", "int", (800, 60_000), null=0.2)]),
        T("stats", "stat line", "stat lines", 400, [
            C("Stat ID", "pk"), C("Player ID", "fk", "players"), C("Game ID", "fk", "games"),
            C("Minutes", "int", (1, 90)), C("Goals", "int", (0, 3))])]),
}
# distractor tables are named <word>_<noun> and get 2-4 of these columns
DISTRACTOR_WORDS = ["legacy", "tmp", "stg", "audit", "old", "import", "backup", "archive", "sync", "report", "etl"]
DISTRACTOR_NOUNS = ["log", "events", "settings", "users", "roles", "metrics", "codes", "notes", "jobs", "files",
                    "contacts", "addresses", "regions", "batches", "versions", "alerts", "tags", "budgets"]
DISTRACTOR_COLS = [("Code", "text"), ("Description", "text"), ("Value", "real"), ("Updated On", "date"),
                   ("Flag (Y/N)", "text"), ("Notes", "text"), ("Count", "int"), ("Name", "text")]
